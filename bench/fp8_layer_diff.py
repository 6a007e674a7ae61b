#!/usr/bin/env python
"""Where an fp8 model departs from its dequantized twin: per-module output differences, one prefill.

Loads one fp8 checkpoint twice on the same backend and device: held in fp8 (`models.fp8`, the fp8
GEMMs) and dequantized on load (the plain GEMMs), runs the same prefill through both with forward
hooks on every linear layer and MoE, and prints each module's relative L2 difference in execution
order (the first large one names the culprit; later ones inherit its error). A diagnostic for the
fp8 GEMMs, not a benchmark.

``python bench/fp8_layer_diff.py CKPT [--backend cuda] [--device cuda] [--tokens 260]``
(``--make ARCH``: first write a tiny fp8 checkpoint with the serving attention dims to CKPT).
"""

from __future__ import annotations

import os
import sys

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
sys.path[:] = [_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]

import argparse  # noqa: E402

import torch  # noqa: E402


def _outputs(model, runner, prompt) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    from models.batch import ForwardMode
    from models.moe.layer import MoE
    from models.parallel import ReplicatedLinear
    from workers.model_runner import WorkItem

    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out, n=name: seen.append((n, out.detach().float().clone())))
             for name, m in model.named_modules() if isinstance(m, (ReplicatedLinear, MoE))]
    try:
        with torch.inference_mode():
            _, hidden = runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt), 0, tuple(range(len(prompt) // 64 + 1)))])
            logits = model.logits(hidden).float()
    finally:
        for h in hooks:
            h.remove()
    return seen, logits


def main() -> None:
    from attention.backend import get_backend
    from attention.cache import PagedKVCache
    from models.dtypes import torch_dtype
    from models.loader import load_model
    from workers.model_runner import ModelRunner
    from workers.rank_build import RankSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--make", choices=["deepseek_v32", "glm_moe_dsa"])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=260)
    ap.add_argument("--show", type=int, default=12)
    args = ap.parse_args()
    if args.make:
        from tests.models.test_fp8_model_gpu import make_fp8_tiny

        make_fp8_tiny(args.make, args.ckpt)
    prompt = [40 + (j * 13) % 80 for j in range(args.tokens)]
    runs = {}
    for fp8 in (False, True):
        spec = RankSpec(args.ckpt, args.backend, args.device, args.dtype, "fp8", num_pages=64, keep_fp8=fp8)
        model = load_model(args.ckpt, torch_dtype(args.dtype), args.device, hadamard=spec.use_hadamard,
                           fp8_weights=fp8)
        cache = PagedKVCache(spec.cache_spec(model.cfg), args.device)
        runs[fp8] = _outputs(model, ModelRunner(model, cache, get_backend(args.backend), args.device), prompt)
    (plain, lp), (quant, lq) = runs[False], runs[True]
    assert [n for n, _ in plain] == [n for n, _ in quant]
    shown = 0
    for (name, a), (_, b) in zip(plain, quant):
        rel = float((a - b).norm() / a.norm().clamp(min=1e-30))
        if rel > 0.02 and shown < args.show:
            print(f"{name:50s} {tuple(a.shape)} rel L2 {rel:.3e}")
            shown += 1
    rels = [float((a - b).norm() / a.norm().clamp(min=1e-30)) for (_, a), (_, b) in zip(plain, quant)]
    print(f"modules: {len(rels)}, median rel L2 {sorted(rels)[len(rels) // 2]:.3e}, max {max(rels):.3e}")
    print(f"logits rel L2 {float((lp - lq).norm() / lp.norm()):.3e}, argmax agree "
          f"{float((lp.argmax(-1) == lq.argmax(-1)).float().mean()):.3f}")


if __name__ == "__main__":
    main()
