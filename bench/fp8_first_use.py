"""Which row counts make the fp8 GEMMs compile a kernel after start-up's warm-up (GPU).

The start-up warm-up (`workers/kernel_warmup.py`) prefills powers of two and the row counts of
`first_use_rows` (``--warm startup``, the default; ``--warm pow2``: powers of two alone, as in
session 16). A served run on the
H100 (docs/perf.md, session 16) stalled for seconds in its first batched requests on an fp8
checkpoint and not on bf16: a kernel compiled on first use. This times, for the DeepSeek-V3.2
projection shapes, the first and the second `models.ops.fp8_linear_cuda.linear` call at each row
count M after the warm-up's row counts ran once: a first call far slower than the second
is a compile (DeepGEMM's JIT or a Triton specialization) that the warm-up did not cover.

    python -m bench.fp8_first_use [--json out.json]

``--grouped``: the same for a prefill's routed experts on DeepGEMM's m-grouped contiguous GEMM
(`models.ops.grouped_gemm_deepgemm`, every prefill of ``MIN_PAIRS`` pairs and up): the warm-up's token
counts from 1,024 up, then other counts, at DeepSeek-V3.2's expert dims with ``--experts`` experts and top-8
routing (session 28: the fp8 checkpoint's start-up passed 560 s, with these kernels' first uses in it).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# (N, K) of the block-quantized projections of one DeepSeek-V3.2 layer: q_a, q_b, kv_a, o_proj,
# indexer wq_b, shared/dense gate_up and down.
SHAPES = [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (8192, 1536), (4096, 7168), (7168, 2048)]
POW2 = [16 << k for k in range(10)]  # 16 .. 8192: session 16's warm-up (powers of two only)
PROBE = [1, 7, 17, 100, 129, 200, 255, 300, 1055, 1536, 3072, 5120, 6144, 7168, 8200]


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> int:
    from models.ops import fp8_linear_cuda as f

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--warm", choices=("startup", "pow2"), default="startup",
                    help="startup: the row counts start-up's warm-up prefills (`workers.kernel_warmup.warmup_sizes` "
                         "for an 8192-token chunk); pow2: the powers of two alone (session 16)")
    ap.add_argument("--grouped", action="store_true", help="probe the routed experts' grouped GEMM instead")
    ap.add_argument("--experts", type=int, default=16)
    args = ap.parse_args()
    if args.grouped:
        return _grouped(args)
    if args.warm == "startup":
        from workers.kernel_warmup import warmup_sizes
        warm = warmup_sizes(8192, 8192)
    else:
        warm = POW2
    dev = torch.device("cuda")
    weights = []
    for n, k in SHAPES:
        w = (torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn)
        s = torch.rand((n + 127) // 128, (k + 127) // 128, device=dev) * 0.01 + 1e-3
        weights.append((w, s))
    rows = []
    for phase, sizes in (("warm-up", warm), ("probe", PROBE)):
        for m in sizes:
            first = second = 0.0
            for (w, s), (n, k) in zip(weights, SHAPES):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                first += _timed(lambda: f.linear(x, w, s, (128, 128)))
                second += _timed(lambda: f.linear(x, w, s, (128, 128)))
            rows.append({"phase": phase, "M": m, "first_ms": first * 1e3, "second_ms": second * 1e3})
            print(f"{phase:8s} M={m:5d}  first {first * 1e3:9.1f} ms  second {second * 1e3:7.2f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "warm": warm, "shapes": SHAPES, "rows": rows}, fh, indent=1)
    return 0


GROUPED_PROBE = [1100, 1536, 3000, 5000, 7000, 8000]


def _grouped(args) -> int:
    """First and second `grouped_gemm_cuda.expert_outputs` call per token count (module docstring)."""
    from models.moe import dispatch
    from models.ops import grouped_gemm_cuda, grouped_gemm_deepgemm as dg
    from workers.kernel_warmup import warmup_sizes

    dev = torch.device("cuda")
    H, I, E, K = 7168, 2048, args.experts, 8
    w13 = (torch.randn(E, 2 * I, H, device=dev) * 0.05).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, device=dev) * 0.05).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2 * I // 128, H // 128, device=dev) * 0.01 + 1e-3
    s2 = torch.rand(E, H // 128, I // 128, device=dev) * 0.01 + 1e-3
    warm = [t for t in warmup_sizes(8192, 8192) if t * K >= dg.MIN_PAIRS]
    rows = []
    for phase, sizes in (("warm-up", warm), ("probe", GROUPED_PROBE)):
        for t in sizes:
            ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(t)])
            x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
            layout = dispatch.contiguous_layout(ids, 0, E, E)
            if not dg.fits(layout, w13, w2, (128, 128)):
                print(f"{phase:8s} T={t:5d}  not on the grouped DeepGEMM path (skipped)")
                continue

            def call():
                grouped_gemm_cuda.expert_outputs(x, w13, w2, layout, w13_scale=s13, w2_scale=s2, block=(128, 128))
            first, second = _timed(call), _timed(call)
            rows.append({"phase": phase, "tokens": t, "first_ms": first * 1e3, "second_ms": second * 1e3})
            print(f"{phase:8s} T={t:5d}  first {first * 1e3:9.1f} ms  second {second * 1e3:7.2f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "experts": E, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
