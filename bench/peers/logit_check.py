"""Logits of dsa-pd's engines against transformers' on a peer checkpoint (a GPU diagnostic).

For ``--prompts`` random 1024-token prompts: transformers' ``AutoModelForCausalLM`` logits (the spec) against
dsa-pd's ``LLM.prompt_logits`` on each ``--variants`` (``cuda``: the served path, bf16 weights, fp8 caches;
``cuda-unfused``: the same without the stacked projections; ``reference``: the reference backend on the
GPU in fp32 with unquantized caches, against transformers in fp32). Prints, per variant, the logits'
relative error (median / max over positions) and the argmax agreement over every position.

    python -m bench.peers.logit_check /tmp/ckpt/bf16 --variants cuda reference
"""

from __future__ import annotations

import argparse

import torch

from bench.offline import random_prompts


def _hf_logits(model_dir: str, prompts, dtype, device: str = "cuda"):
    from bench.peers.agreement import transformers_model

    m = transformers_model(model_dir, device, str(dtype).removeprefix("torch."))
    with torch.no_grad():
        out = [m(torch.tensor([p], device=device)).logits[0].float().cpu() for p in prompts]
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _ours(model_dir: str, prompts, variant: str, device: str = "cuda"):
    from workers.offline import LLM

    kw = dict(backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=256, cuda_graphs=False)
    if variant == "reference":
        kw.update(backend="reference", device=device, dtype="float32", kv_cache_dtype="auto")
    import workers.rank_build as rb

    fuse = rb.fuse_projections
    if variant == "cuda-unfused":
        rb.fuse_projections = lambda model, tp_size=1: 0  # each projection its own GEMM, as the reference runs
    try:
        llm = LLM(model_dir, **kw)
    finally:
        rb.fuse_projections = fuse
    out = [llm.prompt_logits(p) for p in prompts]
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--variants", nargs="*", default=["cuda", "reference"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda", help="cpu: the reference variant alone, on the CPU")
    args = ap.parse_args(argv)
    prompts = random_prompts(args.prompts, args.input_len, 1)
    spec = {}
    for v in args.variants:
        dt = torch.float32 if v == "reference" else torch.bfloat16
        if dt not in spec:
            spec[dt] = _hf_logits(args.model, prompts, dt, args.device)
        ours = _ours(args.model, prompts, v, args.device)
        errs, agree, n = [], 0, 0
        for a, b in zip(spec[dt], ours):
            errs.append((a - b).norm(dim=-1) / a.norm(dim=-1))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            n += a.shape[0]
        e = torch.cat(errs)
        print(f"{v} vs transformers {str(dt)[6:]}: rel err median {e.median():.3e} max {e.max():.3e}; "
              f"argmax agreement {agree / n:.4f} over {n} positions", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
