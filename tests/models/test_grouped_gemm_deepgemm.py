"""The routed experts on DeepGEMM's m-grouped contiguous fp8 GEMM (`models.ops.grouped_gemm_deepgemm`).

* CPU: the padded row layout on fresh random routings (ragged loads: experts with no pair, one expert with
  every pair; expert parallelism's other ranks' pairs), and the glue around the kernel with a stand-in that
  asserts the real kernel's argument contract and writes NaN into the padding rows it skips (a pair that
  read one would poison its output), against the reference grouped GEMM (`grouped_gemm_ref`) within the
  activations' fp8 rounding.
* GPU (``gpu``): DeepSeek-V3.2's expert dims on the real kernel through `grouped_gemm_cuda.expert_outputs`
  (which hands a prefill's fp8 pairs to it) against the reference.

Fresh random inputs each run (``DG_GROUPED_TEST_SEED`` replays one).
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch

pytest.importorskip("triton")

from models.moe import dispatch  # noqa: E402
from models.ops import grouped_gemm_deepgemm as dg  # noqa: E402
from models.ops import grouped_gemm_ref as ref  # noqa: E402
from models.weights import quantize_fp8_block  # noqa: E402

SEED = int(os.environ.get("DG_GROUPED_TEST_SEED", secrets.randbits(31)))


def _routing(T: int, E: int, K: int, gen, kind: str) -> torch.Tensor:
    """int64 ``[T, K]`` distinct expert ids per token: ``random``, ``hot`` (expert 0 in every token), ``narrow``
    (only experts 0..K, so most experts get nothing)."""
    pool = E if kind != "narrow" else K + 1
    ids = torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(T)])
    if kind == "hot":
        has = (ids == 0).any(1)
        ids[~has, 0] = 0
    return ids


@pytest.mark.parametrize("kind", ["random", "hot", "narrow"])
@pytest.mark.parametrize("first,n_local", [(0, 8), (3, 4)])
def test_contiguous_rows_place_every_local_pair_once_in_aligned_runs(kind, first, n_local):
    gen = torch.Generator().manual_seed(SEED)
    T, E, K, align = 37, 8, 3, 16
    ids = _routing(T, E, K, gen, kind)
    layout = dispatch.contiguous_layout(ids, first, n_local, E)
    rows = dg.contiguous_rows(layout, align)
    M = rows.num_rows
    assert M % align == 0 and M == dg.padded_rows_bound(T * K, n_local, align)
    local = (layout.ids.flatten() - first).clamp(min=-1)
    mine = (local >= 0) & (local < n_local)
    r = rows.row_of_pair
    assert len(set(r[mine].tolist())) == int(mine.sum())                        # one row each
    assert torch.equal(rows.m_indices[r[mine]].long(), local[mine])              # its expert's run
    assert torch.equal(rows.token_of_row[r[mine]], torch.arange(T * K)[mine] // K)
    assert bool((rows.m_indices[r[~mine]] == -1).all())                          # others: a padding row
    assert int((rows.m_indices >= 0).sum()) == int(mine.sum())                   # nothing else is live
    m = rows.m_indices.tolist()
    for i, e in enumerate(m):  # a run starts on an aligned row, and runs are in expert order
        if e >= 0 and (i == 0 or m[i - 1] != e):
            assert i % align == 0 and all(x < e for x in m[:i] if x >= 0), (i, e)


def _fp8_experts(E: int, H: int, I: int, gen):
    """Random experts block-quantized at 128 x 128: (w13 fp8 ``[E, 2I, H]``, w2 fp8 ``[E, H, I]``, their scales)."""
    w13 = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn)
    w2 = torch.empty(E, H, I, dtype=torch.float8_e4m3fn)
    s13 = torch.empty(E, 2 * I // 128, H // 128)
    s2 = torch.empty(E, H // 128, I // 128)
    for e in range(E):
        w13[e], s13[e] = quantize_fp8_block(torch.randn(2 * I, H, generator=gen) / H**0.5, (128, 128))
        w2[e], s2[e] = quantize_fp8_block(torch.randn(H, I, generator=gen) / I**0.5, (128, 128))
    return w13, w2, s13, s2


def _act_quant(x: torch.Tensor, group: int = 128, rows: int | None = None):
    """The torch spec of `fp8_linear_cuda.act_quant`'s rounding (fp8 ``[M, K]``, f32 scales ``[M, K/128]``)."""
    M, K = x.shape
    xf = x.float().view(M, K // group, group)
    s = xf.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (xf / s[..., None]).to(torch.float8_e4m3fn).view(M, K), s


def _w8a8_spec(x, w13, w2, s13, s2, layout) -> torch.Tensor:
    """bf16 ``[T * top_k, H]``: the pipeline the kernel path computes, in torch, expert by expert: activations
    quantized per 1 x 128 group (`_act_quant`), products against the dequantized weights in fp32, bf16 outputs,
    SiLU-and-multiply in fp32, the second quantization. Local pairs only (the rest zero)."""
    from models.weights import dequantize_fp8_block

    K, I = layout.top_k, w2.shape[2]
    y = torch.zeros(layout.num_pairs, w2.shape[1], dtype=torch.bfloat16, device=x.device)

    def w8a8(a, w, sc):
        q, sf = _act_quant(a)
        return ((q.float() * sf.repeat_interleave(128, 1)) @ dequantize_fp8_block(w, sc, (128, 128), torch.float32).T
                ).to(torch.bfloat16)

    for e, (s0, c) in enumerate(zip(layout.row_start.tolist(), layout.counts.tolist())):
        if c:
            pairs = layout.pairs[s0:s0 + c].long()
            gu = w8a8(x[pairs // K], w13[e], s13[e]).float()
            y[pairs] = w8a8((torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16), w2[e], s2[e])
    return y


def _stand_in(align: int):
    calls = []

    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
        (q, sf), (w, w_sf) = a, b
        M, Kd = q.shape
        E, N, _ = w.shape
        assert q.dtype == w.dtype == torch.float8_e4m3fn and sf.dtype == w_sf.dtype == torch.float32
        assert sf.shape == (M, Kd // 128) and w_sf.shape == (E, N // 128, Kd // 128) and w.shape[2] == Kd
        assert d.dtype == torch.bfloat16 and d.shape == (M, N) and m_indices.dtype == torch.int32
        assert m_indices.shape == (M,) and M % align == 0 and int(m_indices.max()) < E
        xs = q.float() * sf.repeat_interleave(128, 1)
        d.fill_(float("nan"))  # rows it skips (-1) keep whatever was there
        for e in m_indices.unique().tolist():
            if e < 0:
                continue
            sel = m_indices == e
            we = w[e].float() * w_sf[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            d[sel] = (xs[sel] @ we.T).to(torch.bfloat16)
        calls.append(M)

    return m_grouped_fp8_gemm_nt_contiguous, calls


def test_expert_outputs_glue_against_the_reference(monkeypatch):
    gen = torch.Generator().manual_seed(SEED + 1)
    H, I, E, K, T, align = 256, 128, 6, 3, 70, 16
    w13, w2, s13, s2 = _fp8_experts(E, H, I, gen)
    gemm, calls = _stand_in(align)
    monkeypatch.setattr(dg, "_grouped_gemm", lambda: gemm)
    monkeypatch.setattr(dg, "alignment", lambda: align)
    monkeypatch.setattr(dg.fp8_linear_cuda, "act_quant", _act_quant)
    monkeypatch.setattr(dg, "MIN_PAIRS", 16)
    monkeypatch.setattr(dg, "SILU_BLOCK_ROWS", 48)  # several blocks, the last one partial
    for kind, (first, n_local) in (("random", (0, 6)), ("hot", (0, 6)), ("narrow", (2, 3))):
        ids = _routing(T, E, K, gen, kind)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        sl = slice(first, first + n_local)
        layout = dispatch.contiguous_layout(ids, first, n_local, E)
        # Expert parallelism keeps the Triton kernel (rows are sized for every pair); the glue still holds there.
        assert dg.fits(layout, w13[sl], w2[sl], (128, 128)) == (n_local == E)
        y = dg.expert_outputs(x, w13[sl], w2[sl], layout, s13[sl], s2[sl], (128, 128))
        want = ref.expert_outputs(x.float(), w13[sl], w2[sl], layout, w13_scale=s13[sl], w2_scale=s2[sl],
                                  block=(128, 128))
        mine = layout.local_pairs().flatten()
        got, want = y[mine].float(), want[mine].float()
        assert torch.isfinite(got).all(), kind  # no local pair read a padding row
        # Against the same W8A8 pipeline in torch: its bf16 roundings (a value on an e4m3 rounding boundary may
        # land on the other side); against the plain reference: two activation quantizations (~2^-4 a value).
        spec = _w8a8_spec(x, w13[sl], w2[sl], s13[sl], s2[sl], layout)[mine].float()
        assert float((got - spec).abs().max()) <= 2e-2 * float(spec.abs().max()), kind
        assert float((got - want).abs().max()) <= 0.12 * float(want.abs().max()), kind
    assert len(calls) == 6  # two grouped GEMMs per call
    masked = dispatch.masked_layout(ids, 0, E, E)
    assert not dg.fits(masked, w13, w2, (128, 128)) and not dg.fits(layout, w13, w2, (64, 128))
    full = dispatch.contiguous_layout(ids, 0, E, E)
    assert dg.fits(full, w13, w2, (128, 128))
    monkeypatch.setattr(dg, "MIN_PAIRS", T * K + 1)
    assert not dg.fits(full, w13, w2, (128, 128))
    monkeypatch.setattr(dg, "MIN_PAIRS", T * K)
    monkeypatch.setenv(dg.SWITCH_ENV, "0")  # the bisecting switch: off
    assert not dg.fits(full, w13, w2, (128, 128))
    monkeypatch.setenv(dg.SWITCH_ENV, "1")
    assert dg.fits(full, w13, w2, (128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("T,kind", [(2048, "random"), (1024, "hot"), (4096, "narrow")])
def test_deepgemm_contiguous_experts_gpu(T, kind):
    from models.ops import grouped_gemm_cuda

    gen = torch.Generator().manual_seed(SEED + T)
    H, I, E, K = 7168, 2048, 16, 8
    w13, w2, s13, s2 = (t.cuda() for t in _fp8_experts(E, H, I, gen))
    ids = _routing(T, E, K, gen, kind).cuda()
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    layout = dispatch.contiguous_layout(ids, 0, E, E)
    assert dg.fits(layout, w13, w2, (128, 128)), "DeepGEMM's grouped GEMM should take a prefill's pairs"
    y = grouped_gemm_cuda.expert_outputs(x, w13, w2, layout, w13_scale=s13, w2_scale=s2, block=(128, 128))
    want = ref.expert_outputs(x, w13, w2, layout, w13_scale=s13, w2_scale=s2, block=(128, 128)).float()
    spec = _w8a8_spec(x, w13, w2, s13, s2, layout).float()
    err = float((y.float() - want).abs().max()) / float(want.abs().max())
    err_spec = float((y.float() - spec).abs().max()) / float(spec.abs().max())
    print(f"DEEPGEMM GROUPED T={T} {kind}: max rel err {err:.3e} against the bf16 reference, {err_spec:.3e} "
          f"against the W8A8 spec (align {dg.alignment()})")
    assert torch.isfinite(y).all() and err_spec <= 2e-2 and err <= 0.12, (err_spec, err)
