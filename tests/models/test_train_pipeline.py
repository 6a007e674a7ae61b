"""models.train end to end on a toy: corpus -> tokenizer -> three training stages (resumed) -> checkpoint.

The corpus is made from the standard library's docstrings (the Debian text
packages the real corpus reads need not be on a CI machine); the model is
`models.train.arch.PIPELINE_TEST`, the shipped architecture at toy width.
"""

from __future__ import annotations

import inspect
import json
import re

import numpy as np
import pytest
import torch

from models.train.corpus import doc_string, prepare, read_documents, read_tokens
from models.train.export import export_checkpoint
from models.train.sources import Doc
from models.train.train import Trainer, TrainArgs, train
from tests.workers.hf_tiny import use_tie_rule

_MODULES = ("json", "textwrap", "string", "heapq", "bisect", "argparse", "collections", "functools",
            "itertools", "pathlib", "re", "csv", "random", "statistics", "fractions", "decimal")


def _text_docs():
    for name in _MODULES:
        mod = __import__(name)
        for obj in [mod, *(getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_"))]:
            doc = inspect.getdoc(obj) if callable(obj) or obj is mod else None
            for para in re.split(r"\n\s*\n", doc or ""):
                if len(para) > 60:
                    yield Doc("text", " ".join(para.split()))


def _chat_docs():
    for name in sorted(dir(str)):
        doc = inspect.getdoc(getattr(str, name)) if not name.startswith("_") else None
        if doc:
            yield Doc("chat", messages=[{"role": "user", "content": f"What does str.{name} do?"},
                                        {"role": "assistant", "content": doc.split("\n\n")[0]}])


def _args(root, steps: int) -> TrainArgs:
    return TrainArgs(data=str(root / "corpus"), out=str(root / "run"), arch="pipeline_test", steps=steps,
                     batch=4, seq_len=32, lr=1e-2, indexer_lr=1e-2, warmup_frac=0.1, eval_every_steps=4,
                     log_every=1, eval_windows=4, phases="dense=0.5,warmup=0.2,sparse=0.3", device="cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("train")
    manifest = prepare(root / "corpus", vocab_size=384, budgets={"text": None, "chat": None},
                       sources={"text": _text_docs, "chat": _chat_docs}, heldout_fraction=0.15, model_max_length=64)
    first = _args(root, steps=16)
    first.stop_after_minutes = 0.0  # one step, then the state is saved and the call returns
    assert train(first) is None and not (root / "run" / "checkpoint").exists()
    assert train(_args(root, steps=8)) is not None  # resumes at step 1
    last = _args(root, steps=16)
    last.export = str(root / "export")
    ckpt = train(last)  # resumes from state.pt at step 8
    return root, manifest, ckpt


def test_corpus_split_and_tokens_round_trip(run):
    root, manifest, _ = run
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "corpus" / "tokenizer")
    train_docs = read_documents(root / "corpus" / "corpus.train.jsonl.xz")
    held = read_documents(root / "corpus" / "corpus.heldout.jsonl")
    assert train_docs and held
    assert not {d.key() for d in train_docs} & {d.key() for d in held}
    assert any(d.messages for d in train_docs) and any(not d.messages for d in train_docs)
    ids = read_tokens(root / "corpus" / "train.bin")
    assert ids.dtype == np.uint16 and ids.size == manifest["files"]["train.bin"]["tokens"]
    # Byte-level BPE is lossless: the token file decodes to the documents, specials included.
    assert tok.decode(ids.tolist()) == "".join(doc_string(d) for d in train_docs)
    chat = next(d for d in train_docs if d.messages)
    assert doc_string(chat) == tok.apply_chat_template(chat.messages, tokenize=False)
    assert (ids == tok.bos_token_id).sum() == len(train_docs)


def test_stages_resume_and_loss_falls(run):
    root, _, _ = run
    log = json.loads((root / "run" / "log.json").read_text())
    steps = [e["step"] for e in log["train"]]
    assert steps == list(range(1, 17)), "the resumed run continues the first one's steps"
    assert [e["phase"] for e in log["train"]][:1] == ["dense"]
    assert {e["phase"] for e in log["train"]} == {"dense", "warmup", "sparse"}
    first, last = log["train"][0]["lm_loss"], np.mean([e["lm_loss"] for e in log["train"][-3:]])
    assert last < first - 0.3, (first, last)
    assert log["eval"][-1]["lm_loss"] < log["eval"][0]["lm_loss"]
    assert all(e["mtp_loss"] is not None and e["indexer_kl"] >= 0 for e in log["train"])
    assert (root / "run" / "loss.png").exists() or (root / "run" / "loss.svg").exists()


def test_warmup_stage_trains_only_the_indexers(run):
    root, _, _ = run
    args = _args(root, steps=16)
    args.out = str(root / "fresh")
    t = Trainer(args)
    main0 = [p.detach().clone() for p in t.model.main_parameters()]
    idx0 = [p.detach().clone() for p in t.model.indexer_parameters()]
    t.train_step("warmup")
    assert all(torch.equal(a, p) for a, p in zip(main0, t.model.main_parameters()))
    assert any(not torch.equal(a, p) for a, p in zip(idx0, t.model.indexer_parameters()))
    t.train_step("sparse")
    assert any(not torch.equal(a, p) for a, p in zip(main0, t.model.main_parameters()))


def test_export_unpacks_to_the_checkpoint(run, tmp_path):
    root, _, ckpt = run
    from models.train.export import unpack_parts

    exported = sorted(p.name for p in (root / "export").iterdir())
    assert len(exported) <= 8 and "log.json" in exported  # what one device call can return
    out = unpack_parts(root / "export", tmp_path / "small")
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == sorted(p.name for p in out.iterdir()) and "train_info.json" in files
    assert all((ckpt / f).read_bytes() == (out / f).read_bytes() for f in files)


def test_checkpoint_equals_transformers_and_ours(run):
    root, _, ckpt = run
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.offline import LLM

    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.chat_template
    hf = use_tie_rule(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                           attn_implementation="eager").eval())
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    ours = LLM(ckpt, dtype="float32", kv_cache_dtype="auto")
    text = "Return a list of the words in the string, using sep as the delimiter string."
    ids = tok(text)["input_ids"]
    assert len(ids) > hf.config.index_topk  # the indexer selects
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours.prompt_logits(ids), ref, rtol=1e-4, atol=1e-4)
    chat = tok.apply_chat_template([{"role": "user", "content": "What does str.split do?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [ids[:5], tok(chat, add_special_tokens=False)["input_ids"]]
    got = ours.generate(prompts, max_new_tokens=12, ignore_eos=True)
    for p, g in zip(prompts, got):
        # Teacher-forced on our continuation, transformers' argmax must pick our token at every step,
        # unless its top two are within fp32 rounding (a toy trained for 16 steps has near-flat heads).
        with torch.no_grad():
            logits = hf(torch.tensor([p + g])).logits[0, len(p) - 1:-1].float()
        top2 = logits.topk(2, dim=-1)
        chose = logits.gather(1, torch.tensor(g)[:, None])[:, 0]
        assert ((top2.values[:, 0] - chose) <= 1e-4).all(), (p, g, logits.argmax(-1).tolist())
        assert (top2.values[:, 0] - top2.values[:, 1] > 1e-4).sum() >= len(g) // 2  # mostly clear choices


def test_exported_mtp_layer_is_the_trained_one(run, tmp_path):
    """Our engine's MTP draft logits on an fp32 export equal the training model's MTP logits."""
    root, _, _ = run
    from models.batch import ForwardMode
    from workers.model_runner import WorkItem
    from workers.offline import LLM

    t = Trainer(_args(root, steps=16))  # resumes the finished run's state
    ckpt = export_checkpoint(t.model, tmp_path / "fp32", root / "corpus" / "tokenizer", dtype=torch.float32)
    ids = read_tokens(root / "corpus" / "heldout.bin")[:40].astype(np.int64)
    t.model.eval()
    _, want = t.model.logits(torch.from_numpy(ids)[None], "sparse")
    llm = LLM(ckpt, dtype="float32", kv_cache_dtype="auto")
    pages = llm.pool.allocate_for_tokens(len(ids))
    try:
        with torch.inference_mode():
            _, hidden = llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(ids.tolist()), 0, tuple(pages))])
            batch = llm.runner.build_batch(ForwardMode.PREFILL, [WorkItem(tuple(ids[1:].tolist()), 0, tuple(pages))])
            got, _, _ = llm.model.mtp_forward(batch, hidden[:-1], llm.runner.cache, llm.runner.backend)
    finally:
        llm.pool.free(pages)
    # Ties in the indexer's top-k are broken by position in ours, arbitrarily by torch.topk in training.
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=2e-4)
