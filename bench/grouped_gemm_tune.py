"""Tile sweep of the routed-expert grouped GEMMs (``models/ops/grouped_gemm_cuda.py``) on the GPU.

For each decode / prefill case (experts E, top-k, tokens T, masked or contiguous layout)
and each GEMM (gate_up with ``w13 [E, 2I, H]``, down with ``w2 [E, H, I]``), every
candidate config is timed (``triton.testing.do_bench``, median) and checked against the
default config's output; printed beside the default and the weight-read roofline (bytes
of the experts the routing touched / HBM bandwidth):

    python -m bench.grouped_gemm_tune --hidden 7168 --inter 2048 --experts 16 256 --tokens 1 32 128 1024
"""

from __future__ import annotations

import argparse
import itertools

import torch

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def _bandwidth() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in HBM_BYTES_PER_S.items() if k in name), 3.35e12)


def candidates(gate_up: bool, contiguous: bool = False, quick: bool = False):
    """Tile configs to time; ``contiguous``: also the launch order (``GROUP_M``, 0 = the 2-D grid);
    ``quick``: the prefill tiles only (a prefill-sized case takes ~0.1 s per config)."""
    tiles = ((128,), (128, 256), (64,), (8,), (3, 4)) if quick else \
        ((16, 32, 64, 128), (64, 128), (64, 128, 256), (4, 8), (3, 4))
    for BM, BN, BK, warps, stages in itertools.product(*tiles):
        if (BM + BN * (2 if gate_up else 1)) * BK * stages * 2 > 220_000:  # shared memory of the a and w tiles
            continue
        for group_m in ((0, 4, 8, 16) if contiguous else (0,)):
            cfg = dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)
            yield dict(cfg, GROUP_M=group_m) if group_m else cfg


def experts(E: int, H: int, I: int, gen):
    """Random bf16 ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, one expert at a time (fp32 temporaries of
    all 256 would not fit)."""
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda")
    for e in range(E):
        w13[e] = torch.randn(2 * I, H, generator=gen, device="cuda") / H**0.5
        w2[e] = torch.randn(H, I, generator=gen, device="cuda") / I**0.5
    return w13, w2


def run_case(H: int, I: int, E: int, K: int, T: int, masked: bool, gen, top: int, weights, quick: bool = False) -> None:
    import triton

    from models.moe import dispatch
    from models.ops import grouped_gemm_cuda as cu

    ids = torch.rand(T, E, generator=gen, device="cuda").argsort(dim=1)[:, :K]
    layout = (dispatch.masked_layout if masked else dispatch.contiguous_layout)(ids, 0, E, E)
    touched = int(torch.unique(ids).numel())
    x = torch.randn(T, H, generator=gen, device="cuda").bfloat16()
    w13, w2 = weights
    P = layout.num_pairs
    act = torch.empty(P, I, dtype=x.dtype, device="cuda")
    y = torch.empty(P, H, dtype=x.dtype, device="cuda")
    bw = _bandwidth()
    for name, a, w, out, N, Kd, a_div, gu in (("gate_up", x, w13, act, I, H, K, True), ("down", None, w2, y, H, I, 1, False)):
        if a is None:
            a = act
        default = cu.gemm_config(layout.expected_m, N, Kd, gu)
        maps: dict = {}
        cu._launch(a, w, out, layout, N, Kd, a_div, gu, maps, default)
        want = out.clone()
        results = []
        for cfg in [default] + [c for c in candidates(gu, not masked, quick) if c != default]:
            cfg = dict(cfg, BN=min(cfg["BN"], max(16, triton.next_power_of_2(N))),
                       BK=min(cfg["BK"], max(16, triton.next_power_of_2(Kd))))
            maps = {}
            try:
                out.zero_()
                cu._launch(a, w, out, layout, N, Kd, a_div, gu, maps, cfg)
                ok = torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2)
                ms = triton.testing.do_bench(lambda: cu._launch(a, w, out, layout, N, Kd, a_div, gu, maps, cfg),
                                             warmup=5, rep=30)
            except Exception as e:  # noqa: BLE001 - a config the compiler or the GPU refuses
                results.append((float("inf"), cfg, f"error {type(e).__name__}"))
                continue
            results.append((ms, cfg, "ok" if ok else "WRONG"))
        read = touched * (2 * I * H if gu else H * I) * 2 / bw * 1e3
        flop = 2 * P * N * Kd * (2 if gu else 1)
        d_ms = results[0][0]
        print(f"E={E} top{K} T={T} {'masked' if masked else 'contiguous'} {name}: {touched} experts touched, "
              f"weight read {read * 1e3:.1f} us; default {d_ms * 1e3:.1f} us ({flop / d_ms / 1e9:.0f} TFLOP/s) "
              f"{results[0][1]}", flush=True)
        for ms, cfg, status in sorted((r for r in results if r[2] == "ok"), key=lambda r: r[0])[:top]:
            print(f"    {ms * 1e3:8.1f} us  {ms / d_ms:5.2f}x default  {read / ms:5.2f} of roofline  "
                  f"{flop / ms / 1e9:4.0f} TFLOP/s  {cfg}")
        bad = [r for r in results if r[2] == "WRONG"]
        if bad:
            print(f"    {len(bad)} configs gave WRONG results, e.g. {bad[0][1]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--experts", type=int, nargs="*", default=[16, 256])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 32, 128, 1024])
    p.add_argument("--contiguous-from", type=int, default=512, help="T at and above which the prefill layout is timed")
    p.add_argument("--top", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="prefill tiles and launch orders only")
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    for E in args.experts:
        weights = experts(E, args.hidden, args.inter, gen)
        for T in args.tokens:
            run_case(args.hidden, args.inter, E, args.top_k, T, T < args.contiguous_from, gen, args.top, weights,
                     args.quick)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
