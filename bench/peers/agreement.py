"""Greedy agreement between two engines on the same prompts: an independent correctness check.

Reads two ``--json`` results (``dsa-pd bench offline`` and ``bench/peers/vllm_offline.py``),
pairs their decode cases by batch size (same seed, same prompts), and reports per case how
many requests agree token for token, the mean length of the agreeing prefix, and, where a
request diverges, dsa-pd's logit margin at the first divergence: ``logit[dsa-pd's token] -
logit[peer's token]`` from ``LLM.prompt_logits`` over the prompt and the agreed prefix, divided
by the standard deviation of that logit row (so random-weight logit scales compare). A
small margin (a near-tie) says the two engines' numerics picked different sides of a coin
flip; a large one would say one of them computes something else. ``--judge-dtype float32`` also asks
transformers (the checkpoint through ``AutoModelForCausalLM``, in that dtype) at each first divergence:
which token it picks there (``ours``, ``peer`` or ``neither``), the third opinion that tells a wrong
engine from a checkpoint whose greedy output rounding alone flips (docs/perf.md, session 27).

    python -m bench.peers.agreement ours.json peer.json --model CKPT --backend cuda --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench.offline import random_prompts


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def compare(ours: dict, peer: dict, llm=None, seed: int = 1, max_margins: int = 8, judge=None) -> list[dict]:
    """One row per batch size present in both results. ``judge``: token ids -> the fp32 logits row after them
    (transformers': `transformers_judge`), asked at each of the first ``max_margins`` divergences."""
    theirs = {c["batch"]: c for c in peer["cases"] if c.get("token_ids")}
    rows = []
    for c in ours["cases"]:
        if not c.get("token_ids") or c["batch"] not in theirs or "output_len" not in c:
            continue
        p = theirs[c["batch"]]
        prompts = random_prompts(c["batch"], c["input_len"], seed)
        divs = [first_divergence(a, b) for a, b in zip(c["token_ids"], p["token_ids"])]
        agreed = [len(a) if d is None else d for a, d in zip(c["token_ids"], divs)]
        margins, picks = [], []
        asked = [i for i, d in enumerate(divs) if d is not None][:max_margins]
        for i in asked:
            d = divs[i]
            context, a, b = prompts[i] + c["token_ids"][i][:d], c["token_ids"][i][d], p["token_ids"][i][d]
            if llm is not None:
                row = llm.prompt_logits(context)[-1]
                # In units of the row's logit spread: random weights can make logits large.
                margins.append(float(row[a] - row[b]) / float(row.std()))
            if judge is not None:
                top = int(judge(context).argmax())
                picks.append("ours" if top == a else "peer" if top == b else "neither")
        rows.append({"batch": c["batch"], "requests": len(divs), "identical": sum(d is None for d in divs),
                     "mean_agreed_tokens": statistics.fmean(agreed), "output_len": c["output_len"],
                     "first_divergence_margins": margins, "judge_picks": picks})
    return rows


def transformers_model(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    """transformers' own ``AutoModelForCausalLM`` of the checkpoint, in ``dtype``, on ``device``, eval mode."""
    import torch
    import transformers

    kw = {} if device == "cpu" else {"device_map": device}
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **kw).eval()


def transformers_judge(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    """transformers' own model of the checkpoint as a judge: token ids -> fp32 logits after the last one."""
    import torch

    m = transformers_model(model_dir, device, dtype)

    def judge(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return m(torch.tensor([ids], device=m.device)).logits[0, -1].float().cpu()

    return judge


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours")
    ap.add_argument("peer")
    ap.add_argument("--model", default=None, help="checkpoint, to compute the logit margins (dsa-pd's LLM)")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--judge-dtype", default=None,
                    help="also ask transformers in this dtype (e.g. float32) which token it picks at each divergence")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ours, peer = (json.load(open(p)) for p in (args.ours, args.peer))
    llm = None
    if args.model:
        from workers.offline import LLM

        llm = LLM(args.model, backend=args.backend, device=args.device, dtype=args.dtype, kv_cache_dtype="fp8",
                  num_pages=2048, cuda_graphs=False)
    judge = None
    if args.model and args.judge_dtype:
        from pathlib import Path

        if "quantization_config" in json.loads((Path(args.model) / "config.json").read_text()):
            # transformers would run its own fp8 path, not the spec: judge on the bf16 checkpoint instead.
            print(f"judge skipped: {args.model} is fp8 block-quantized")
        else:
            judge = transformers_judge(args.model, args.device, args.judge_dtype)
    rows = compare(ours, peer, llm, args.seed, judge=judge)
    print("| batch | identical / requests | mean agreed tokens | margins at first divergence (logit std units) "
          "| transformers picks |")
    print("|---|---|---|---|---|")
    for r in rows:
        m = ", ".join(f"{x:.3f}" for x in r["first_divergence_margins"]) or "-"
        picks = ", ".join(f"{k} {r['judge_picks'].count(k)}" for k in ("ours", "peer", "neither")) if r["judge_picks"] else "-"
        print(f"| {r['batch']} | {r['identical']} / {r['requests']} | {r['mean_agreed_tokens']:.1f} of "
              f"{r['output_len']} | {m} | {picks} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
