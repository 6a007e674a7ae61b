"""MTP draft acceptance of a trained checkpoint on held-out text, for 1, 2 and 3 draft tokens.

For every held-out document (`models.train.corpus`: ``corpus.heldout.jsonl``)
the prompt is its first ``--prompt-tokens`` tokens (a chat document: its
rendered conversation up to the last assistant turn, with the generation
prompt), and the offline engine (`workers.offline.LLM`) continues it greedily
for ``--new-tokens`` tokens, all prompts in one batch, once without MTP and
once per draft count. From the engine's stats (``LLM.stats``) it reports per
draft count ``k``:

* ``accepted_per_step``: drafts accepted per verify step (0..k), and its histogram;
* ``tokens_per_step``: tokens emitted per verify step (accepted + 1);
* ``acceptance_rate``: accepted / drafted;
* ``equal_to_no_mtp``: prompts whose greedy output equals the run without MTP
  (all of them, up to fp32/bf16 near-ties in the verify logits);
* ``wall_s`` of the whole generate call, for reference only (not a decode
  speed: prefill is included and the CPU is shared).

    python -m bench.mtp_acceptance --model models/checkpoints/small-v32 \\
        --heldout .cache/corpus/corpus.heldout.jsonl --json docs/mtp_acceptance_cpu.json
    python -m bench.mtp_acceptance --model ... --backend cuda --device cuda --dtype bfloat16 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

__all__ = ["heldout_prompts", "measure"]


def heldout_prompts(path: str | Path, tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``n`` usable prompts of a held-out corpus file (module docstring), as token ids."""
    from models.train.corpus import read_documents

    out = []
    for d in read_documents(path):
        if d.messages:
            msgs = d.messages[:-1] if d.messages[-1]["role"] == "assistant" else d.messages
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(d.text)["input_ids"]
            if len(ids) < prompt_tokens:
                continue
            ids = ids[:prompt_tokens]
        out.append(ids)
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(f"{path} has only {len(out)} usable prompts, {n} asked")
    return out


def _run(model: str, prompts, new_tokens: int, draft: int, opts: dict) -> tuple[list[list[int]], dict, float]:
    from workers.offline import LLM

    llm = LLM(model, mtp_draft_tokens=draft, max_batch_size=max(len(prompts), 1), **opts)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
        if opts.get("device", "cpu") != "cpu":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        return outs, llm.stats(), wall
    finally:
        llm.shutdown()


def measure(model: str, prompts: list[list[int]], new_tokens: int, drafts: list[int], opts: dict) -> dict:
    """Acceptance figures (module docstring) for every draft count in ``drafts``."""
    base, _, base_wall = _run(model, prompts, new_tokens, 0, opts)
    res = {"no_mtp": {"wall_s": round(base_wall, 2)}}
    for k in drafts:
        outs, st, wall = _run(model, prompts, new_tokens, k, opts)
        hist = {int(a): int(c) for a, c in sorted(st["mtp_accepted_histogram"].items())}
        steps = sum(hist.values())
        accepted = sum(a * c for a, c in hist.items())
        res[f"draft_{k}"] = {
            "verify_steps": steps,
            "accepted_per_step": round(accepted / steps, 4) if steps else None,
            "tokens_per_step": round(accepted / steps + 1, 4) if steps else None,
            "acceptance_rate": round(st["mtp_acceptance_rate"], 4),
            "histogram": {str(a): hist.get(a, 0) for a in range(k + 1)},
            "equal_to_no_mtp": sum(o == b for o, b in zip(outs, base)),
            "wall_s": round(wall, 2),
        }
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (with its tokenizer)")
    ap.add_argument("--heldout", default=".cache/corpus/corpus.heldout.jsonl")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--json", default=None, help="write the results here too")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = heldout_prompts(a.heldout, tok, a.prompts, a.prompt_tokens)
    opts = dict(backend=a.backend, device=a.device, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype)
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if a.device != "cpu" else f"cpu ({torch.get_num_threads()} threads)"}
    out = {"model": a.model, "env": env, "options": opts, "prompts": len(prompts),
           "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1), "new_tokens": a.new_tokens,
           "results": measure(a.model, prompts, a.new_tokens, a.drafts, opts)}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
