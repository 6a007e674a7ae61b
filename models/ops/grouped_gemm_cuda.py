"""Routed-expert GEMMs in Triton: only the routed experts' rows are computed
and only their weights are read.

Same signatures and semantics as ``grouped_gemm_ref`` (the spec), for bf16 /
fp16 (and fp32, exact ``ieee`` dot) activations and weights, fp32
accumulation; fp8 block-quantized weights are dequantized tile by tile in
registers (weight-only fp8: half the weight bytes of bf16, the same products). Three kernels per MoE layer:

1. ``gate_up``: grouped GEMM of the routed tokens with ``w13``; a program
   computes the same ``BN`` columns of gate and of up and writes
   ``silu(gate) * up`` (``[T * top_k, I]``, row = pair) -- the
   intermediate ``[*, 2I]`` never goes to memory;
2. ``down``: grouped GEMM of those rows with ``w2`` -> ``[T * top_k, H]``;
3. ``combine``: ``out[t] = sum_k w[t, k] * y[t * top_k + k]`` in fp32, over
   this rank's pairs, fixed slot order (deterministic: no atomics).

Both GEMMs gather their input rows through the layout's pair table
(token ``pair // top_k`` for gate_up, row ``pair`` for down) and scatter
their output rows to row ``pair``, so the ``[E_local, max_m, H]`` activation
tensor of the masked layout is never materialized. Grids:

* masked layout (decode, CUDA graphs): ``(E_local, n-tiles)``; program
  ``(e, n)`` loops over the m-tiles ``< cdiv(counts[e], BM)`` of expert
  ``e``: an expert with no pairs runs zero iterations and reads none of its
  weights (at batch 1 of 256 experts, top-8: 8 experts' weights are read).
  ``counts`` stays on the device: the grid depends only on shapes. (A grid
  over ``cdiv(max_m, BM)`` m-tiles as well would launch ``max_m / BM`` times
  more programs, nearly all of them empty at decode sizes.)
* contiguous layout (prefill): a tile map (built on the device by a few
  fixed-shape torch ops) gives each of ``cdiv(T * top_k, BM) + E_local``
  programs one (expert, m-tile) of a run; spare programs run zero iterations.

Tile sizes follow the expected rows per expert (``layout.expected_m``):
`gemm_config`, from the sweep of bench/grouped_gemm_tune.py.

A prefill's fp8 experts with bf16 activations go to DeepGEMM's m-grouped contiguous fp8 GEMM instead
(`models.ops.grouped_gemm_deepgemm`: fp8 tensor cores, from `grouped_gemm_deepgemm.MIN_PAIRS` pairs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from models.ops import grouped_gemm_deepgemm

if TYPE_CHECKING:
    from models.moe.dispatch import ExpertLayout

_NO_TILE = 1 << 30  # m-tile index of a spare contiguous-grid program: past every run


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_stride,
    w_ptr, w_stride_e, w_stride_n,
    s_ptr, s_stride_e, s_stride_n,
    out_ptr, out_stride,
    pairs_ptr, row_start_ptr, counts_ptr,
    tile_expert_ptr, tile_m_ptr,
    N: tl.constexpr, K: tl.constexpr, A_DIV: tl.constexpr, GATE_UP: tl.constexpr, TILE_MAP: tl.constexpr,
    W_FP8: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr = 0, num_m_programs=1,
):
    """out[pair] = a[pair // A_DIV] @ w[e, :N]^T over expert e's pairs (GATE_UP:
    silu(a @ w[e, :N]^T) * (a @ w[e, N:2N]^T)); w ``[E, *, K]`` with unit K stride.

    W_FP8: w is float8_e4m3fn with block scales ``s[e, row // B0, k // B1]``; each
    weight tile is dequantized in registers to a's dtype (BK divides B1).

    GROUP_M > 0 (contiguous layout): a 1-D grid walked GROUP_M m-programs at a time across every
    n-tile, so the programs resident together share their activation rows in L2. The 2-D grid
    (GROUP_M = 0) runs every m-tile of n-tile 0 first, and a prefill's gathered rows then stream
    from HBM once per n-tile."""
    if GROUP_M > 0:
        num_n = tl.cdiv(N, BN)
        flat = tl.program_id(0)
        in_group = GROUP_M * num_n
        first_m = (flat // in_group) * GROUP_M
        size_m = tl.minimum(num_m_programs - first_m, GROUP_M)
        pid = first_m + (flat % in_group) % size_m
        pid_n = (flat % in_group) // size_m
    else:
        pid = tl.program_id(0)
        pid_n = tl.program_id(1)
    if TILE_MAP:  # one (expert, m-tile) per program
        e = tl.load(tile_expert_ptr + pid)
        mt = tl.load(tile_m_ptr + pid)
        count = tl.load(counts_ptr + e)
        mt_end = tl.minimum(mt + 1, tl.cdiv(count, BM))
    else:  # one expert per program, all its m-tiles (none if it has no pairs)
        e = pid
        mt = 0
        count = tl.load(counts_ptr + e)
        mt_end = tl.cdiv(count, BM)
    start = tl.load(row_start_ptr + e)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    w_rows = w_ptr + e.to(tl.int64) * w_stride_e + offs_n.to(tl.int64)[:, None] * w_stride_n  # [BN, 1]
    s_rows = s_ptr + e.to(tl.int64) * s_stride_e + (offs_n // B0) * s_stride_n  # [BN] (W_FP8)
    s_rows_up = s_ptr + e.to(tl.int64) * s_stride_e + ((offs_n + N) // B0) * s_stride_n
    # A `while`: Triton 3.6's interpreter cannot take a run-time `range` bound loaded from memory.
    while mt < mt_end:
        offs_m = mt * BM + tl.arange(0, BM)
        m_ok = offs_m < count
        pair = tl.load(pairs_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
        a_rows = a_ptr + (pair // A_DIV)[:, None] * a_stride  # [BM, 1]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < K
            a = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
            if W_FP8:
                s = tl.load(s_rows + k0 // B1, mask=n_ok, other=0.0)
                w = (w.to(tl.float32) * s[:, None]).to(a.dtype)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
            if GATE_UP:
                wu = tl.load(w_rows + N * w_stride_n + offs_k[None, :], mask=w_mask, other=0.0)
                if W_FP8:
                    su = tl.load(s_rows_up + k0 // B1, mask=n_ok, other=0.0)
                    wu = (wu.to(tl.float32) * su[:, None]).to(a.dtype)
                acc_up = tl.dot(a, tl.trans(wu), acc_up, input_precision=PRECISION)
        if GATE_UP:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        out = out_ptr + pair[:, None] * out_stride + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
        mt += 1


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, ids_ptr, out_ptr, H, first_expert, num_local,
    TOP_K: tl.constexpr, ALL_LOCAL: tl.constexpr, BH: tl.constexpr,
):
    """out[t, h] = sum_k w[t, k] * y[t * TOP_K + k, h] over this rank's pairs, fp32, slot order."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        p = t * TOP_K + k
        w = tl.load(w_ptr + p)
        ok = h_ok
        if not ALL_LOCAL:
            local = tl.load(ids_ptr + p) - first_expert
            mine = (local >= 0) & (local < num_local)
            ok = h_ok & mine
            w = tl.where(mine, w, 0.0)
        y = tl.load(y_ptr + p * H + offs, mask=ok, other=0.0)
        acc += w * y.to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _masked_dispatch_kernel(ids_ptr, P, first_expert, max_m, pairs_ptr, row_start_ptr, counts_ptr,
                            BLOCK_P: tl.constexpr):
    """Program e: the pairs routed to local expert e, in pair order, into pairs[e, :count]."""
    e = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    ok = p < P
    ids = tl.load(ids_ptr + p, mask=ok, other=-1)
    match = (ok & (ids == e + first_expert)).to(tl.int32)
    pos = tl.cumsum(match, axis=0) - 1
    row = e * max_m
    tl.store(pairs_ptr + row + pos, p, mask=match != 0)
    tl.store(row_start_ptr + e, row)
    tl.store(counts_ptr + e, tl.sum(match, axis=0))


MASKED_DISPATCH_MAX_PAIRS = 16384  # one program scans every pair; beyond this, the torch builder


def masked_layout(ids: torch.Tensor, first_expert: int, num_local: int, n_experts: int,
                  max_m: int | None = None) -> ExpertLayout:
    """``dispatch.masked_layout`` in one kernel (plus the table's fill): equal to it entry for
    entry. Decode steps build their layout here: the torch builder is ~20 small kernels, which
    cost more than a batch-1 MoE's GEMMs take to launch."""
    from models.moe.dispatch import ExpertLayout
    from models.moe.dispatch import masked_layout as torch_masked_layout

    T, P = ids.shape[0], ids.numel()
    max_m = T if max_m is None else max_m
    if P > MASKED_DISPATCH_MAX_PAIRS or P == 0 or num_local == 0 or max_m < T:
        return torch_masked_layout(ids, first_expert, num_local, n_experts, max_m)
    pairs = torch.full((num_local, max_m), -1, dtype=torch.int32, device=ids.device)
    row_start = torch.empty(num_local, dtype=torch.int32, device=ids.device)
    counts = torch.empty(num_local, dtype=torch.int32, device=ids.device)
    _masked_dispatch_kernel[(num_local,)](ids.contiguous(), P, first_expert, max_m, pairs, row_start, counts,
                                          BLOCK_P=triton.next_power_of_2(P), num_warps=4)
    return ExpertLayout(pairs, row_start, counts, ids, first_expert, n_experts, max_m)


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def gemm_config(expected_m: int, N: int, K: int, gate_up: bool = False) -> dict:
    """Tile sizes and launch options for a grouped GEMM of ``expected_m`` rows per expert.

    Every m-tile of an expert reads that expert's weight tile again, so BM is chosen to
    hold an expert's rows in one tile with room for routing imbalance (about twice the
    mean), not to fit the mean. Measured on the H100 (bench/grouped_gemm_tune.py, H 7168,
    I 2048, top-8; docs/perf.md "Grouped GEMM tiles"): at 16 experts and 32 tokens (16
    rows per expert on average) BM 32 takes 0.67-0.71x the time of BM 16 and reaches
    0.81-0.86 of the weight-read roofline; prefill-sized runs take the large tiles."""
    if expected_m <= 8:  # decode over many experts: memory-bound on the weights
        cfg = dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4)
    elif expected_m <= 16:
        cfg = dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=4)
    elif expected_m <= 32:
        cfg = dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4)
    elif expected_m <= 64:  # 16 experts at batch 128: 0.69x (gate_up) / 0.78x (down) the time of BM 64
        cfg = dict(BM=128, BN=64, BK=128, num_warps=8, num_stages=3)
    else:  # prefill: compute-bound, the large tiles (0.82x the time of BM 64 at 512 rows per expert),
        # walked in groups of 16 m-tiles (`_grouped_gemm_kernel`'s GROUP_M). H100, 16 experts, 8192
        # tokens (docs/perf.md, session 19): gate_up 6.42 ms (599 TFLOP/s); down with BN 256 3.12 ms
        # (617 TFLOP/s) against 4.37 with BN 128 (gate_up's two weight tiles leave no room for BN 256)
        cfg = dict(BM=128, BN=128 if gate_up else 256, BK=64, num_warps=8, num_stages=3, GROUP_M=16)
    cfg["BN"] = min(cfg["BN"], _pow2_at_least_16(N))
    cfg["BK"] = min(cfg["BK"], _pow2_at_least_16(K))
    return cfg


def tile_map(counts: torch.Tensor, BM: int, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, m-tile) int32 of each program of the contiguous grid: ``cdiv(num_pairs, BM) +
    E_local`` programs (a bound on the runs' tiles), spare ones pointing past every run.
    Fixed-shape device ops: nothing is read back to the host."""
    E = counts.shape[0]
    tiles = (counts.long() + BM - 1) // BM
    end = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(num_pairs, BM) + E, device=counts.device)
    e = torch.searchsorted(end, t, right=True)
    valid = e < E
    e = e.clamp(max=E - 1)
    mt = torch.where(valid, t - (end[e] - tiles[e]), _NO_TILE)
    return e.to(torch.int32), mt.to(torch.int32)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(a, w, out, layout: ExpertLayout, N: int, K: int, a_div: int, gate_up: bool, maps: dict,
            cfg: dict | None = None, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> None:
    """One grouped GEMM (``cfg``: tile sizes and launch options, default `gemm_config`'s; the tuning
    bench, bench/grouped_gemm_tune.py, passes its candidates). ``scale`` / ``block``: fp8 ``w``."""
    cfg = dict(cfg or gemm_config(layout.expected_m, N, K, gate_up))
    if scale is not None:
        # One scale column per K tile: BK must divide the block's width.
        cfg["BK"] = min(cfg["BK"], block[1])
        if block[1] % cfg["BK"]:
            raise ValueError(f"fp8 block width {block[1]} is not a multiple of the K tile {cfg['BK']}")
    BM = cfg["BM"]
    if layout.masked:
        tile_e = tile_m = layout.counts  # unused
        programs = layout.num_local
    else:
        if BM not in maps:
            maps[BM] = tile_map(layout.counts, BM, layout.num_pairs)
        tile_e, tile_m = maps[BM]
        programs = tile_e.shape[0]
    s, b0, b1 = (scale, block[0], block[1]) if scale is not None else (w, 1, 1)  # s unused without fp8
    group_m = cfg.pop("GROUP_M", 0)
    if layout.masked:
        group_m = 0  # the masked grid is one program per expert
    n_tiles = triton.cdiv(N, cfg["BN"])
    grid = (programs * n_tiles,) if group_m else (programs, n_tiles)
    _grouped_gemm_kernel[grid](
        a, a.stride(0), w, w.stride(0), w.stride(1), s, s.stride(0), s.stride(1), out, out.stride(0),
        layout.pairs, layout.row_start, layout.counts, tile_e, tile_m,
        N=N, K=K, A_DIV=a_div, GATE_UP=gate_up, TILE_MAP=not layout.masked, W_FP8=scale is not None,
        B0=b0, B1=b1, PRECISION=_precision(a.dtype), GROUP_M=group_m, num_m_programs=programs, **cfg,
    )


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout,
                   w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """x ``[T, H]``, w13 ``[E_local, 2I, H]``, w2 ``[E_local, H, I]`` -> ``[T * top_k, H]``
    (x's dtype; rows of other ranks' pairs are left unwritten: ``combine`` skips them).

    fp8 weights (float8_e4m3fn) come with ``w13_scale [E_local, 2I / b0, ceil(H / b1)]``,
    ``w2_scale [E_local, ceil(H / b0), ceil(I / b1)]`` and ``block``; x keeps its dtype and the
    kernels dequantize each weight tile in registers."""
    fp8 = w13_scale is not None
    if fp8 != (w2_scale is not None) or fp8 != (block is not None) or fp8 != (w13.dtype == torch.float8_e4m3fn):
        raise ValueError("fp8 expert weights need both scale stacks and the block, and only fp8 weights take them")
    E, I2, H = w13.shape
    I = I2 // 2
    if tuple(w2.shape) != (E, H, I) or x.shape[-1] != H or layout.num_local != E:
        raise ValueError(f"shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"{layout.num_local} local experts in the layout")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights need a unit stride along their input dim")
    if not fp8:
        x = x.to(w13.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if fp8 and x.dtype == torch.bfloat16 and grouped_gemm_deepgemm.fits(layout, w13, w2, block):
        # A prefill's pairs: W8A8 on fp8 tensor cores (this kernel dequantizes to bf16 ones).
        return grouped_gemm_deepgemm.expert_outputs(x, w13, w2, layout, w13_scale, w2_scale, block)
    P = layout.num_pairs
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    if P == 0 or E == 0:
        return y
    maps: dict = {}
    _launch(x, w13, act, layout, I, H, layout.top_k, True, maps, scale=w13_scale, block=block)
    _launch(act, w2, y, layout, H, I, 1, False, maps, scale=w2_scale, block=block)
    return y


def combine(y: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """y ``[T * top_k, H]``, weights fp32 ``[T, top_k]`` -> ``[T, H]`` (y's dtype)."""
    T, K = weights.shape
    H = y.shape[-1]
    y = y.contiguous()
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    BH = min(1024, _pow2_at_least_16(H))
    _combine_kernel[(T, triton.cdiv(H, BH))](
        y, weights.float().contiguous(), layout.ids.contiguous(), out, H, layout.first_expert, layout.num_local,
        TOP_K=K, ALL_LOCAL=layout.all_local, BH=BH, num_warps=4,
    )
    return out


def routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout,
                   weights: torch.Tensor, **scales) -> torch.Tensor:
    """This rank's routed-expert contribution ``[T, H]`` (summed over ranks by the caller)."""
    return combine(expert_outputs(x, w13, w2, layout, **scales), weights, layout)
