"""Triton grouped GEMMs (``models/ops/grouped_gemm_cuda.py``) vs the torch reference.

* ``test_*_interpreter``: CPU tensors through Triton's interpreter, in one
  subprocess with ``TRITON_INTERPRET=1`` (this file run as a script: the
  variable must be set before ``triton`` is imported). fp16 and fp32 (the
  interpreter misreads bf16 tensors); tiny shapes.
* ``test_kernels_compile_for_sm90``: the kernels compile to sm_90 cubins on
  the CPU (Triton ships ptxas), with the K loop software-pipelined.
* ``test_*_gpu`` (``gpu`` mark): compiled, at DeepSeek-V3.2 dims, in
  tests/models/test_moe_gpu.py.

Skipped where triton is not installed. Inputs are random with a fresh seed per
run (``MOE_TEST_SEED`` replays one).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from models.moe import dispatch  # noqa: E402
from models.ops import grouped_gemm_ref as ref  # noqa: E402
from tests.triton_interpreter import compile_run, compiled, kernel_suite, worker_main  # noqa: E402

SEED = int(os.environ.get("MOE_TEST_SEED", secrets.randbits(31)))


def routing(T: int, E: int, K: int, gen, kind: str) -> torch.Tensor:
    """Distinct expert ids per token: ``random``; ``hot`` (expert 1 in every token);
    ``one_group`` (every token picks experts [E - K, E): one run per expert of all T tokens,
    all other experts empty)."""
    if kind == "one_group":
        return torch.arange(E - K, E).repeat(T, 1)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    if kind == "hot":
        for t in range(T):
            rest = [e for e in ids[t].tolist() if e != 1][: K - 1]
            ids[t] = torch.tensor([1] + rest)
    return ids


def _scale(t: torch.Tensor) -> float:
    return max(1.0, float(t.abs().max())) if t.numel() else 1.0


def check_grouped_gemm(gen, device: str, dims: dict, dtypes, cases) -> None:
    """Triton expert outputs (rows of this rank's pairs) and the combined output == reference."""
    from models.ops import grouped_gemm_cuda as cu

    H, I, E, K = dims["H"], dims["I"], dims["E"], dims["K"]
    for dtype in dtypes:
        w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype).to(device)
        w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype).to(device)
        for T, kind, (first, n_local) in cases:
            ids = routing(T, E, K, gen, kind).to(device)
            x = torch.randn(T, H, generator=gen).to(dtype).to(device)
            wts = torch.rand(T, K, generator=gen).to(device)
            ws = (w13[first:first + n_local], w2[first:first + n_local])
            unused = sorted(set(range(first, first + n_local)) - set(ids.flatten().tolist()))
            saved = (w13[unused].clone(), w2[unused].clone())
            # Experts with no pairs: NaN weights, which must reach no output (the kernels skip them;
            # the masked reference runs them over padding rows only, whose outputs are dropped).
            w13[unused] = float("nan")
            w2[unused] = float("nan")
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for make in (dispatch.contiguous_layout, dispatch.masked_layout):
                layout = make(ids, first, n_local, E)
                label = f"{dtype} T={T} {kind} experts [{first}, {first + n_local}) {make.__name__}"
                mine = layout.local_pairs().flatten()
                y = cu.expert_outputs(x, *ws, layout)
                y_ref = ref.expert_outputs(x, *ws, layout)
                got, want = y[mine].float(), y_ref[mine].float()
                assert torch.isfinite(got).all() and torch.isfinite(want).all(), label
                torch.testing.assert_close(got, want, rtol=tol, atol=tol * _scale(want),
                                           msg=lambda m, label=label: f"{label}: {m}")
                out = cu.combine(y, wts, layout).float()
                out_ref = ref.combine(y_ref, wts, layout).float()
                torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol * _scale(out_ref),
                                           msg=lambda m, label=label: f"{label} combined: {m}")
            w13[unused], w2[unused] = saved


def check_interpreter_small(gen) -> None:
    """Decode-sized tiles (BM 16); dims not multiples of the tiles (masked edges); ragged loads;
    expert-parallel slices, one with no local pair at all."""
    dims = dict(H=48, I=40, E=8, K=3)
    check_grouped_gemm(gen, "cpu", dims, (torch.float16,),
                       [(1, "random", (0, 8)), (5, "random", (4, 4)), (37, "hot", (0, 8)), (6, "one_group", (0, 4))])
    check_grouped_gemm(gen, "cpu", dims, (torch.float32,), [(19, "one_group", (0, 8))])


def check_interpreter_prefill_tiles(gen) -> None:
    """Enough pairs per expert for the prefill tiles (BM 64): several m-tiles per run."""
    check_grouped_gemm(gen, "cpu", dict(H=64, I=32, E=4, K=2), (torch.float32,), [(150, "hot", (2, 2))])


def check_grouped_order(gen) -> None:
    """The contiguous grid walked GROUP_M m-programs at a time (the prefill order): every (program,
    n-tile) once, a partial last group, several n-tiles; equal to the 2-D grid's order bit for bit and
    to the reference."""
    from models.ops import grouped_gemm_cuda as cu

    H, I, E, K, T = 48, 40, 8, 3, 37
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    x = torch.randn(T, H, generator=gen)
    layout = dispatch.contiguous_layout(routing(T, E, K, gen, "random"), 0, E, E)
    want = ref.expert_outputs(x, w13, w2, layout)
    got = {}
    for group_m in (0, 4):  # 15 m-programs of BM 16: three groups of 4, then one of 3
        cfg = dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=2, GROUP_M=group_m)
        act = torch.full((layout.num_pairs, I), float("nan"))
        y = torch.full((layout.num_pairs, H), float("nan"))
        maps: dict = {}
        cu._launch(x, w13, act, layout, I, H, K, True, maps, cfg=cfg)
        cu._launch(act, w2, y, layout, H, I, 1, False, maps, cfg=cfg)
        got[group_m] = y
    assert torch.equal(got[0], got[4])
    torch.testing.assert_close(got[4], want, rtol=1e-5, atol=1e-5)


def check_tile_map(gen) -> None:
    from models.ops.grouped_gemm_cuda import tile_map

    for counts in ([0, 5, 0, 33, 16, 0], [0, 0, 0], [64, 0, 1]):
        c = torch.tensor(counts, dtype=torch.int32)
        for BM in (16, 64):
            e, mt = tile_map(c, BM, sum(counts))
            seen = sorted((int(a), int(b)) for a, b in zip(e, mt) if int(b) < (int(c[int(a)]) + BM - 1) // BM)
            want = [(x, m) for x, n in enumerate(counts) for m in range(-(-n // BM))]
            assert seen == want, (counts, BM, seen, want)


def check_masked_dispatch(gen) -> None:
    """The one-kernel masked layout == the torch builder, entry for entry."""
    from models.ops import grouped_gemm_cuda as cu

    E, K = 16, 4
    for T, kind in ((1, "random"), (13, "random"), (13, "hot"), (9, "one_group")):
        ids = routing(T, E, K, gen, kind)
        for first, n_local in ((0, E), (8, 8)):
            for max_m in (None, T + 3):
                got = cu.masked_layout(ids, first, n_local, E, max_m)
                want = dispatch.masked_layout(ids, first, n_local, E, max_m)
                for f in ("pairs", "row_start", "counts"):
                    assert torch.equal(getattr(got, f), getattr(want, f)), (T, kind, first, max_m, f)
                assert got.max_m == want.max_m and got.n_experts == E and got.first_expert == first


CHECKS = {
    "masked_dispatch": check_masked_dispatch,
    "grouped_gemm_small": check_interpreter_small,
    "grouped_gemm_prefill_tiles": check_interpreter_prefill_tiles,
    "grouped_gemm_grouped_order": check_grouped_order,
    "tile_map": check_tile_map,
}


PRESTART, interpreter_results, test_grouped_gemm_interpreter = kernel_suite(__file__, SEED, CHECKS, "MOE_TEST_SEED", "test_kernels_compile_for_sm90")
"""The subprocesses this module reads, started early (tests/prestart.py); the interpreter checks' fixture and test."""


# --------------------------------------------------------------------------- sm_90 compile


def _compile_worker() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.ops import grouped_gemm_cuda as cu

    def compile_one(fn, sig, consts, options, aligned):
        # 16-byte aligned pointers and strides, as the launcher specializes them at run time
        # (without that the K loop is not pipelined).
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    # DeepSeek-V3.2: gate_up of a decode step (masked) and down of a prefill chunk (contiguous),
    # bf16 and fp8 (128 x 128 block scales) weights.
    for fp8 in (False, True):
        sig = dict(a_ptr="*bf16", a_stride="i64", w_ptr="*fp8e4nv" if fp8 else "*bf16", w_stride_e="i64",
                   w_stride_n="i64", s_ptr="*fp32", s_stride_e="i64", s_stride_n="i64", out_ptr="*bf16",
                   out_stride="i64", pairs_ptr="*i32", row_start_ptr="*i32", counts_ptr="*i32",
                   tile_expert_ptr="*i32", tile_m_ptr="*i32", num_m_programs="i32")
        for expected_m, gate_up, tile_map, (N, K) in ((1, True, False, (2048, 7168)),
                                                      (512, False, True, (7168, 2048))):
            cfg = cu.gemm_config(expected_m, N, K, gate_up)
            cfg.setdefault("GROUP_M", 0)
            assert (cfg["GROUP_M"] > 0) == tile_map  # prefill runs the grouped order
            options = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
            k = compile_one(cu._grouped_gemm_kernel, sig,
                            dict(N=N, K=K, A_DIV=8 if gate_up else 1, GATE_UP=gate_up, TILE_MAP=tile_map,
                                 W_FP8=fp8, B0=128 if fp8 else 1, B1=128 if fp8 else 1, PRECISION="tf32", **cfg),
                            options, [n for n in sig if n.endswith(("_ptr", "stride"))])
            ir = k.asm["ttgir"]
            assert "async_copy_global_to_local" in ir, f"K loop not pipelined ({expected_m=}, {gate_up=}, {fp8=})"
    compile_one(cu._combine_kernel, dict(y_ptr="*bf16", w_ptr="*fp32", ids_ptr="*i64", out_ptr="*bf16", H="i32",
                                         first_expert="i32", num_local="i32"),
                dict(TOP_K=8, ALL_LOCAL=False, BH=1024), dict(num_warps=4), ["y_ptr", "out_ptr"])
    compile_one(cu._masked_dispatch_kernel, dict(ids_ptr="*i64", P="i32", first_expert="i32", max_m="i32",
                                                 pairs_ptr="*i32", row_start_ptr="*i32", counts_ptr="*i32"),
                dict(BLOCK_P=1024), dict(num_warps=4), ["ids_ptr", "pairs_ptr"])


def test_kernels_compile_for_sm90():
    compiled(compile_run(__file__))


if __name__ == "__main__":
    worker_main(sys.argv[1:], CHECKS, _compile_worker)
