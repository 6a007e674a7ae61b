"""Build the training corpus, its tokenizer and its token files, offline and deterministically.

    apt-get install -y python3.11-doc fortunes fortunes-min jargon-text debian-reference-en dict-gcide \
        linux-doc-6.1
    python -m models.train.corpus --out .cache/corpus

writes into ``--out`` (``.cache/`` is git-ignored; the directory is what the
GPU host needs, carried with the training command, see docs/training.md):

=========================  ====================================================
``corpus.train.jsonl.xz``  the training documents, one JSON object a line:
                           ``{"source", "text"}`` or ``{"source", "messages"}``
``corpus.heldout.jsonl``   the held-out documents (same form), never trained on
``tokenizer/``             the Hugging Face tokenizer (`models.train.tokenizer`)
``train.bin``              uint16 token ids of every training document, each
                           ``<|bos|> text <|eos|>`` (chats: the chat template), concatenated
``heldout.bin``            the same for the held-out documents
``manifest.json``          sources, budgets, package versions, counts, sha256 of the files
=========================  ====================================================

Documents come from `models.train.sources` in reader order, de-duplicated,
capped per source by a character budget, then shuffled with a fixed seed.
Dictionary entries are kept only for words that occur in the prose sources
(so the model learns common words, not 1913 chemistry). A document is
held out when the first byte of the sha256 of its text is below
``heldout_fraction * 256``: the split does not depend on order or budgets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import random
import re
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np

from models.train.sources import PACKAGES, SOURCES, Doc
from models.train.tokenizer import BOS_ID, EOS_ID, render_chat, train_tokenizer

__all__ = ["DEFAULT_BUDGETS", "collect_documents", "split_documents", "encode_documents", "prepare", "read_tokens"]

DEFAULT_BUDGETS: dict[str, int | None] = {
    "pydocs": None,        # None: the whole source
    "kerneldocs": 8_000_000,  # characters
    "fortunes": None,
    "jargon": None,
    "jargon_chat": None,
    "debref": None,
    "gcide": 5_000_000,    # characters
    "gcide_chat": 1_500_000,
}
_DICT_SOURCES = ("gcide", "gcide_chat")
_WORD = re.compile(r"[a-z]+")


def collect_documents(budgets: dict[str, int | None], sources=SOURCES, min_word_count: int = 3) -> list[Doc]:
    """Every source's documents in reader order, de-duplicated, each source cut at its budget.

    Dictionary sources (``gcide*``) keep only headwords seen ``>= min_word_count``
    times in the prose sources read before them.
    """
    unknown = sorted(set(budgets) - set(sources))
    if unknown:
        raise ValueError(f"budgets name unknown sources {unknown}; known: {sorted(sources)}")
    docs: list[Doc] = []
    seen: set[str] = set()
    words: Counter[str] = Counter()
    for name in sorted(budgets, key=lambda n: n in _DICT_SOURCES):  # prose first: it defines "common"
        budget, used = budgets[name], 0
        for d in sources[name]():
            if name in _DICT_SOURCES and words[d.head] < min_word_count:
                continue
            key = d.key()
            if key in seen:
                continue
            if budget is not None and used + len(key) > budget:
                break
            seen.add(key)
            used += len(key)
            docs.append(d)
            if name not in _DICT_SOURCES:
                words.update(_WORD.findall(key.lower()))
    return docs


def is_heldout(doc: Doc, fraction: float) -> bool:
    """The split rule of the module docstring."""
    return hashlib.sha256(doc.key().encode()).digest()[0] < fraction * 256


def split_documents(docs: list[Doc], heldout_fraction: float, seed: int) -> tuple[list[Doc], list[Doc]]:
    """(train, heldout), each shuffled with ``seed``."""
    train = [d for d in docs if not is_heldout(d, heldout_fraction)]
    held = [d for d in docs if is_heldout(d, heldout_fraction)]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def doc_string(doc: Doc) -> str:
    """The string a document is encoded from: ``<|bos|>text<|eos|>``, or the rendered chat."""
    if doc.messages:
        return render_chat(doc.messages)
    return f"<|bos|>{doc.text}<|eos|>"


def encode_documents(tokenizer, docs: list[Doc]) -> np.ndarray:
    """uint16 ``[n_tokens]``: the documents' token ids, concatenated in order."""
    if len(tokenizer) > 65536:
        raise ValueError(f"uint16 token files need a vocabulary of at most 65536, got {len(tokenizer)}")
    enc = tokenizer.backend_tokenizer.encode_batch([doc_string(d) for d in docs], add_special_tokens=False)
    ids = np.fromiter((i for e in enc for i in e.ids), dtype=np.uint16)
    return ids


def _doc_json(d: Doc) -> str:
    return json.dumps({"source": d.source, "messages": d.messages} if d.messages else
                      {"source": d.source, "text": d.text}, ensure_ascii=False)


def read_documents(path: str | Path) -> list[Doc]:
    """Documents of a ``corpus.*.jsonl`` (or ``.jsonl.xz``) file."""
    path = Path(path)
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [Doc(o["source"], o.get("text", ""), o.get("messages", [])) for o in map(json.loads, f)]


def read_tokens(path: str | Path) -> np.ndarray:
    """uint16 token ids of a ``*.bin`` written by :func:`prepare`."""
    return np.fromfile(path, dtype=np.uint16)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _package_versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", p], capture_output=True, text=True)
        out[p] = r.stdout.strip() if r.returncode == 0 else "not installed"
    return out


def prepare(out: str | Path, vocab_size: int = 4096, budgets: dict[str, int | None] | None = None,
            heldout_fraction: float = 0.02, seed: int = 0, model_max_length: int = 1024,
            sources=SOURCES) -> dict:
    """Write the module docstring's files into ``out``; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = dict(DEFAULT_BUDGETS if budgets is None else budgets)
    docs = collect_documents(budgets, sources)
    train, held = split_documents(docs, heldout_fraction, seed)
    if not train or not held:
        raise ValueError(f"the split left {len(train)} training and {len(held)} held-out documents: "
                         "give more documents or another heldout_fraction")
    # xz preset 6 without threads: the same bytes on every machine.
    with lzma.open(out / "corpus.train.jsonl.xz", "wt", encoding="utf-8", preset=6) as f:
        for d in train:
            f.write(_doc_json(d) + "\n")
    with open(out / "corpus.heldout.jsonl", "w", encoding="utf-8") as f:
        for d in held:
            f.write(_doc_json(d) + "\n")

    # The tokenizer learns from the training documents only (chats through the template's contents).
    texts = (d.text if not d.messages else "\n".join(m["content"] for m in d.messages) for d in train)
    tok = train_tokenizer(texts, vocab_size, model_max_length)
    tok.save_pretrained(out / "tokenizer")
    files = {}
    for name, part in (("train.bin", train), ("heldout.bin", held)):
        ids = encode_documents(tok, part)
        ids.tofile(out / name)
        files[name] = {"tokens": int(ids.size)}
    counts = Counter(d.source for d in train)
    manifest = {
        "vocab_size": len(tok),
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "seed": seed,
        "heldout_fraction": heldout_fraction,
        "budgets": budgets,
        "packages": _package_versions(),
        "documents": {"train": len(train), "heldout": len(held), "train_by_source": dict(sorted(counts.items()))},
        "characters": {"train": sum(len(d.key()) for d in train), "heldout": sum(len(d.key()) for d in held)},
        "files": files,
    }
    for name in ("corpus.train.jsonl.xz", "corpus.heldout.jsonl", "train.bin", "heldout.bin"):
        manifest["files"].setdefault(name, {})["sha256"] = _sha256(out / name)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (e.g. .cache/corpus)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--heldout-fraction", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    m = prepare(args.out, args.vocab_size, heldout_fraction=args.heldout_fraction, seed=args.seed)
    print(json.dumps({k: m[k] for k in ("documents", "characters", "files")}, indent=2))


if __name__ == "__main__":
    main()
