"""Fused top-k of the indexer logits, emitting FlashMLA indices directly.

Per row ``r`` the candidates are the columns ``t < lengths[r]`` of
``logits[r]`` whose logit is not ``-inf`` (the reference ``topk_slots``'s
rule: ragged prefill rows arrive ``-inf``-masked outside ``[ks, ke)``);
anything past the length is never read. The kernel selects the ``topk``
largest candidates by a radix select on order-preserving uint32 keys, one
program per row:

1. Up to four passes of 8 bits (most significant first): histogram the next
   digit of every candidate that still matches the prefix chosen so far and
   pick the bin in which the ``topk``-th largest falls. The search stops early
   when that bin is taken whole, or when the row has no more than ``topk``
   candidates (then all of them are taken).
2. One output pass: every key above the threshold is taken, and of the keys
   equal to it (the tie group) the first ``k_remaining`` by position. Output
   offsets come from prefix sums, so the selected set is written in ascending
   position order, then ``-1`` padded to ``topk``.

Tie rule: among logits equal to the ``topk``-th largest value, the lowest
positions win (what a stable descending sort picks). ``-0.0`` equals ``+0.0``;
NaN ranks above ``+inf`` (as in ``torch.topk``).

Differences from the reference ``attention.indexer.topk_slots``: the selected
set is the same (up to the order of exact ties, which the reference leaves
unspecified) but listed in ascending position order rather than descending
logit order (FlashMLA does not care), and a position whose page is missing
(beyond the block table's width or a ``-1`` entry) yields slot ``-1`` where
the reference raises.

Cost: each pass re-reads the row (from L2 for the rows of one decode step), so
the kernel moves about five row reads; there is no sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import PAGE_SIZE
from ._bits import float_order_key

NEG_INF_KEY = tl.constexpr(0x007FFFFF)  # float_order_key(-inf): -inf is never a candidate


@triton.jit
def _topk_kernel(
    logits_ptr, logits_stride, L,
    lengths_ptr, K,
    bt_ptr, bt_stride, bt_cols, rows_per_table,
    slots_ptr, pos_ptr, out_stride,
    WRITE_SLOTS: tl.constexpr, WRITE_POS: tl.constexpr,
    PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    # Loops with run-time bounds are `while` loops: Triton 3.6's interpreter
    # turns a run-time `range` bound into a Python int through a 1-element
    # array, which numpy >= 2.4 refuses (compiled code is the same either way).
    row = tl.program_id(0)
    n = tl.maximum(tl.minimum(tl.load(lengths_ptr + row), L), 0)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    bins = tl.arange(0, 256)

    # --- radix select: find the threshold key prefix ------------------------
    # Candidates are the positions < n whose logit is not -inf (ragged prefill
    # rows arrive -inf-masked outside [ks, ke)), as in the reference topk_slots.
    take_all = n <= K  # refined after the first histogram: fewer than K candidates
    done = take_all
    prefix = tl.zeros([], dtype=tl.uint32)  # the chosen high digits of the threshold key
    shift = tl.full([], 24, tl.int32)  # prefix == key >> shift for the tie group
    k_rem = K + tl.zeros([], dtype=tl.int32)  # how many are still to be taken from the tie group
    for p in tl.static_range(4):
        if done == 0:
            hist = tl.zeros([256], dtype=tl.int32)
            start = 0
            while start < n:
                offs = start + tl.arange(0, BLOCK)
                key = float_order_key(tl.load(row_ptr + offs, mask=offs < n, other=0.0))
                m = (offs < n) & (key != NEG_INF_KEY)
                if p > 0:
                    m = m & ((key >> (32 - 8 * p)) == prefix)
                digit = ((key >> (24 - 8 * p)) & 0xFF).to(tl.int32)
                hist += tl.histogram(digit, 256, mask=m)
                start += BLOCK
            if p == 0:
                take_all = tl.sum(hist, axis=0) <= K
            # ge[b] = candidates whose digit is >= b (non-increasing in b); the
            # threshold bin is the last b with ge[b] >= k_rem.
            ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            b = tl.sum((ge >= k_rem).to(tl.int32), axis=0) - 1
            above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
            in_bin = tl.sum(tl.where(bins == b, hist, 0), axis=0)
            k_rem = k_rem - above
            prefix = (prefix << 8) | b.to(tl.uint32)
            shift = tl.full([], 24 - 8 * p, tl.int32)
            # Stop when the whole bin is taken (no need to look at lower
            # digits), or when there are no more candidates than K.
            done = (in_bin == k_rem) | take_all

    # --- output: keys above the threshold + the first k_rem ties -------------
    table_row = (row // rows_per_table).to(tl.int64)
    out_row = row.to(tl.int64) * out_stride
    n_sel = tl.zeros([], dtype=tl.int32)
    n_eq = tl.zeros([], dtype=tl.int32)
    start = 0
    while start < n:
        offs = start + tl.arange(0, BLOCK)
        key = float_order_key(tl.load(row_ptr + offs, mask=offs < n, other=0.0))
        m = (offs < n) & (key != NEG_INF_KEY)
        top = key >> shift.to(tl.uint32)
        gt = m & (take_all | (top > prefix))
        eq = m & (take_all == 0) & (top == prefix)
        eq_i = eq.to(tl.int32)
        eq_rank = n_eq + tl.cumsum(eq_i, axis=0) - eq_i  # ties taken in position order
        sel = gt | (eq & (eq_rank < k_rem))
        sel_i = sel.to(tl.int32)
        dst = n_sel + tl.cumsum(sel_i, axis=0) - sel_i
        # Never true when the select is right; a guard so that a bug could not
        # write into the next row.
        sel = sel & (dst < K)
        if WRITE_SLOTS:
            page_idx = offs // PAGE
            page = tl.load(bt_ptr + table_row * bt_stride + page_idx, mask=sel & (page_idx < bt_cols), other=-1)
            slot = tl.where(page >= 0, page * PAGE + offs % PAGE, -1)
            tl.store(slots_ptr + out_row + dst, slot, mask=sel)
        if WRITE_POS:
            tl.store(pos_ptr + out_row + dst, offs, mask=sel)
        n_eq += tl.sum(eq_i, axis=0)
        n_sel += tl.sum(sel_i, axis=0)
        start += BLOCK
    # Pad [n_sel, K) with -1 (disjoint from the stores above: no ordering hazard).
    start = (n_sel // BLOCK) * BLOCK
    while start < K:
        offs = start + tl.arange(0, BLOCK)
        pad = (offs >= n_sel) & (offs < K)
        if WRITE_SLOTS:
            tl.store(slots_ptr + out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=pad)
        if WRITE_POS:
            tl.store(pos_ptr + out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=pad)
        start += BLOCK


def _check(logits: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits: expected float32 [R, L], got {logits.dtype} {tuple(logits.shape)}")
    R = logits.shape[0]
    if lengths.shape != (R,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths: expected int32 [{R}], got {lengths.dtype} {tuple(lengths.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _launch(logits, lengths, topk, block_table, rows_per_table, slots, positions, block, num_warps):
    R, L = logits.shape
    if R == 0:
        return
    dummy = slots if slots is not None else positions
    bt = block_table if block_table is not None else dummy
    _topk_kernel[(R,)](
        logits, logits.stride(0), L,
        lengths.contiguous(), topk,
        bt, bt.stride(0), bt.shape[1] if block_table is not None else 0, rows_per_table,
        slots if slots is not None else dummy, positions if positions is not None else dummy, topk,
        WRITE_SLOTS=slots is not None, WRITE_POS=positions is not None,
        PAGE=PAGE_SIZE, BLOCK=block, num_warps=num_warps,
    )


def topk_slots(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    block_table: torch.Tensor,
    *,
    rows_per_table: int = 1,
    return_positions: bool = False,
    block: int = 1024,
    num_warps: int = 8,
):
    """Fused top-k over each row's valid prefix -> FlashMLA sparse indices.

    Args:
        logits: float32 ``[R, L]`` indexer logits (unit inner stride); only
            ``logits[r, :lengths[r]]`` is read.
        lengths: int32 ``[R]`` valid lengths (clamped to ``[0, L]``).
        topk: ``k`` (2048 for DeepSeek-V3.2 / GLM-5).
        block_table: int32 ``[T, max_pages]``; row ``r`` uses table row
            ``r // rows_per_table`` (``rows_per_table = next_n`` for the
            ``B * next_n`` rows of an MTP decode step).
        return_positions: also return the selected positions.

    Returns:
        int32 ``[R, topk]`` slots ``page * 64 + offset`` of the selected tokens,
        in ascending position order, ``-1`` padded (a row with ``length <= topk``
        selects all of its tokens); with ``return_positions``,
        ``(positions int32 [R, topk], slots)`` like the reference ``topk_slots``.
        See the module docstring for the tie rule.
    """
    logits = _check(logits, lengths, topk)
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table: expected int32 [T, max_pages], got {block_table.dtype} {tuple(block_table.shape)}")
    R = logits.shape[0]
    if rows_per_table < 1 or (R and (R - 1) // rows_per_table >= block_table.shape[0]):
        raise ValueError(f"{R} rows at {rows_per_table} rows per table need more than {block_table.shape[0]} table rows")
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    slots = torch.empty(R, topk, dtype=torch.int32, device=logits.device)
    positions = torch.empty_like(slots) if return_positions else None
    _launch(logits, lengths, topk, block_table, rows_per_table, slots, positions, block, num_warps)
    return (positions, slots) if return_positions else slots


def topk_positions(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    block: int = 1024,
    num_warps: int = 8,
) -> torch.Tensor:
    """The same selection without a page table: int32 ``[R, topk]`` positions, ascending, ``-1`` padded.

    For prefill, where FlashMLA's sparse kernel indexes a dequantized workspace
    instead of the paged cache.
    """
    logits = _check(logits, lengths, topk)
    positions = torch.empty(logits.shape[0], topk, dtype=torch.int32, device=logits.device)
    _launch(logits, lengths, topk, None, 1, None, positions, block, num_warps)
    return positions
