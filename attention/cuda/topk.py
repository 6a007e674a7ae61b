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

Tie rule (the reference's, attention/API.md): among logits equal to the
``topk``-th largest value, the lowest positions win (what a stable descending
sort picks). ``-0.0`` equals ``+0.0``; NaN ranks above ``+inf`` (as in
``torch.topk``). A row's selection depends on its own logits and length only,
never on the logits width or the other rows (batch invariance).

Differences from the reference ``attention.indexer.topk_slots``: the selected
set is the same, exact ties included, but listed in ascending position
order rather than descending logit order (FlashMLA does not care), and a
position whose page is missing (beyond the block table's width or a ``-1``
entry) yields slot ``-1`` where the reference raises.

Cost: each pass re-reads the row (from L2 for the rows of one decode step), so
the kernel moves about five row reads; there is no sort.

Sampled version (``topk_slots_sampled`` / ``topk_positions_sampled``; what
``topk_slots`` / ``topk_positions`` run for rows of ``>= SAMPLED_MIN_LEN``
logits): one program per row is latency bound (about one row per SM, five
passes over the row), so the row is read twice by many programs and the radix
select runs over a few thousand candidates held in registers. Four launches:

1. threshold (one program per row): ``sample`` evenly spaced logits of the
   row; the lowest key of the 16-bit bin holding their ``r``-th largest key,
   ``r = sample * (k + cap) / 2 / n``, is a threshold ``t`` that about
   ``(k + cap) / 2`` of the row's logits reach (two radix passes).
   Rows of ``<= cap`` logits take ``t = 0`` (every logit is a candidate).
2. count (one program per (row, segment of ``seg`` logits)): the candidates
   (``key >= t``, not ``-inf``) of each segment.
3. compact (same grid): each segment writes its candidates' keys and
   positions at its exclusive-sum offset, so the row's candidate list is in
   position order.
4. select (one program per row): when there are ``k <= c <= cap``
   candidates (or ``t = 0`` let every logit through), they contain the row's
   exact top-k with every tie of the k-th value, so the fused kernel's radix
   select and output step run over them in registers; the result is the
   fused kernel's, bit for bit. Otherwise (the sample missed: too few or too
   many candidates, e.g. a huge tie group) that row runs the fused kernel's
   streaming select instead. Centring the expected count between k and cap
   makes a miss a ~4.6-sigma event for continuous logits at sample 2048, k
   2048, cap 4096 and 32k logits; every miss is still exact, only slower.

No host syncs and scratch sized from shapes only, so it can be captured in a
CUDA graph. (A split kernel, four radix passes with rows cut across programs,
came before it: 0.161 ms graph-replayed at 128 x 34k; removed.)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import PAGE_SIZE
from ._bits import float_order_key

NEG_INF_KEY = tl.constexpr(0x007FFFFF)  # float_order_key(-inf): -inf is never a candidate


@triton.jit
def _store_selection(offs, sel, dst, K, bt_ptr, table_row, bt_stride, bt_cols, slots_ptr, pos_ptr, out_row,
                     WRITE_SLOTS: tl.constexpr, WRITE_POS: tl.constexpr, PAGE: tl.constexpr):
    """Write the selected positions ``offs[sel]`` at output offsets ``dst`` of
    row ``out_row``: slots through page-table row ``table_row`` (-1 for a
    missing page) and/or the positions themselves."""
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


@triton.jit
def _pick_bin(hist, k_rem):
    """One radix step: ``hist`` int32 [256] counts the next digit of the candidates
    still in the running -> ``(b, above, in_bin)``: the bin holding the
    ``k_rem``-th largest, how many candidates lie in higher bins, and in ``b``."""
    bins = tl.arange(0, 256)
    # ge[b] = candidates whose digit is >= b (non-increasing in b); the
    # threshold bin is the last b with ge[b] >= k_rem.
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.sum((ge >= k_rem).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    in_bin = tl.sum(tl.where(bins == b, hist, 0), axis=0)
    return b, above, in_bin


@triton.jit
def _radix_in_registers(key, m, K, PASSES: tl.constexpr = 4):
    """Radix select over one in-register block of uint32 keys (candidates: ``m``).

    Returns ``(prefix, shift, k_rem, take_all)``: the ``K``-th largest key's
    top digits ``prefix == key >> shift``, how many of the keys equal to it in
    those digits are still to be taken, and whether there are no more than
    ``K`` candidates (then all of them are taken). Same steps and early exit as
    the fused kernel's streaming version. ``PASSES < 4`` stops after that many
    8-bit digits: ``prefix << shift`` is then a lower bound of the ``K``-th
    largest key, not the key itself.
    """
    take_all = tl.sum(m.to(tl.int32), axis=0) <= K
    done = take_all
    prefix = tl.zeros([], dtype=tl.uint32)
    shift = tl.full([], 24, tl.int32)
    k_rem = K + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(PASSES):
        if done == 0:
            mp = m
            if p > 0:
                mp = m & ((key >> (32 - 8 * p)) == prefix)
            hist = tl.histogram(((key >> (24 - 8 * p)) & 0xFF).to(tl.int32), 256, mask=mp)
            b, above, in_bin = _pick_bin(hist, k_rem)
            k_rem = k_rem - above
            prefix = (prefix << 8) | b.to(tl.uint32)
            shift = tl.full([], 24 - 8 * p, tl.int32)
            done = in_bin == k_rem
    return prefix, shift, k_rem, take_all


@triton.jit
def _emit_selected(offs, key, m, take_all, prefix, shift, k_rem, n_eq, n_sel, K,
                   bt_ptr, table_row, bt_stride, bt_cols, slots_ptr, pos_ptr, out_row,
                   WRITE_SLOTS: tl.constexpr, WRITE_POS: tl.constexpr, PAGE: tl.constexpr):
    """Output step over one block of candidates (``m``) at positions ``offs``
    (ascending, after every block already emitted): every key above the
    threshold, and of the tie group the ones whose tie rank is ``< k_rem``.
    Returns the updated ``(n_eq, n_sel)`` running counts."""
    top = key >> shift.to(tl.uint32)
    gt = m & (take_all | (top > prefix))
    eq = m & (take_all == 0) & (top == prefix)
    eq_i = eq.to(tl.int32)
    eq_rank = n_eq + tl.cumsum(eq_i, axis=0) - eq_i  # ties taken in position order
    sel = gt | (eq & (eq_rank < k_rem))
    sel_i = sel.to(tl.int32)
    dst = n_sel + tl.cumsum(sel_i, axis=0) - sel_i
    _store_selection(offs, sel, dst, K, bt_ptr, table_row, bt_stride, bt_cols, slots_ptr, pos_ptr, out_row,
                     WRITE_SLOTS, WRITE_POS, PAGE)
    return n_eq + tl.sum(eq_i, axis=0), n_sel + tl.sum(sel_i, axis=0)


@triton.jit
def _pad_row(slots_ptr, pos_ptr, out_row, start, end, n_sel,
             WRITE_SLOTS: tl.constexpr, WRITE_POS: tl.constexpr, BLOCK: tl.constexpr):
    """Write -1 to the output entries ``[max(start, n_sel), end)`` of one row."""
    while start < end:
        offs = start + tl.arange(0, BLOCK)
        pad = (offs >= n_sel) & (offs < end)
        if WRITE_SLOTS:
            tl.store(slots_ptr + out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=pad)
        if WRITE_POS:
            tl.store(pos_ptr + out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=pad)
        start += BLOCK


@triton.jit
def _topk_row(row_ptr, n, K, bt_ptr, table_row, bt_stride, bt_cols, slots_ptr, pos_ptr, out_row,
              WRITE_SLOTS: tl.constexpr, WRITE_POS: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """The whole selection of one row by one program, streaming its ``n`` logits
    (the fused kernel; also the sampled kernel's fallback)."""
    # Loops with run-time bounds are `while` loops: Triton 3.6's interpreter
    # turns a run-time `range` bound into a Python int through a 1-element
    # array, which numpy >= 2.4 refuses (compiled code is the same either way).

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
            b, above, in_bin = _pick_bin(hist, k_rem)
            k_rem = k_rem - above
            prefix = (prefix << 8) | b.to(tl.uint32)
            shift = tl.full([], 24 - 8 * p, tl.int32)
            # Stop when the whole bin is taken (no need to look at lower
            # digits), or when there are no more candidates than K.
            done = (in_bin == k_rem) | take_all

    # --- output: keys above the threshold + the first k_rem ties -------------
    n_sel = tl.zeros([], dtype=tl.int32)
    n_eq = tl.zeros([], dtype=tl.int32)
    start = 0
    while start < n:
        offs = start + tl.arange(0, BLOCK)
        key = float_order_key(tl.load(row_ptr + offs, mask=offs < n, other=0.0))
        m = (offs < n) & (key != NEG_INF_KEY)
        n_eq, n_sel = _emit_selected(offs, key, m, take_all, prefix, shift, k_rem, n_eq, n_sel, K,
                                     bt_ptr, table_row, bt_stride, bt_cols, slots_ptr, pos_ptr, out_row,
                                     WRITE_SLOTS, WRITE_POS, PAGE)
        start += BLOCK
    # Pad [n_sel, K) with -1 (disjoint from the stores above: no ordering hazard).
    _pad_row(slots_ptr, pos_ptr, out_row, (n_sel // BLOCK) * BLOCK, K, n_sel, WRITE_SLOTS, WRITE_POS, BLOCK)


@triton.jit
def _topk_kernel(
    logits_ptr, logits_stride, L,
    lengths_ptr, K,
    bt_ptr, bt_stride, bt_cols, rows_per_table,
    slots_ptr, pos_ptr, out_stride,
    WRITE_SLOTS: tl.constexpr, WRITE_POS: tl.constexpr,
    PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.maximum(tl.minimum(tl.load(lengths_ptr + row), L), 0)
    _topk_row(logits_ptr + row.to(tl.int64) * logits_stride, n, K,
              bt_ptr, (row // rows_per_table).to(tl.int64), bt_stride, bt_cols, slots_ptr, pos_ptr,
              row.to(tl.int64) * out_stride, WRITE_SLOTS, WRITE_POS, PAGE, BLOCK)


# ---------------------------------------------------------------------------
# sampled version: a threshold from a sample of each row, one compaction pass,
# the exact select over the few candidates left
# ---------------------------------------------------------------------------

# Scratch of the sampled version (sized from R, L, seg and cap only; nothing needs an initial value):
# thr      int32 [R]: the row's candidate threshold key (uint32 bits; 0 = every non -inf logit);
# seg_cnt  int32 [R, NSEG]: candidates (key >= thr) per segment;
# cand     int32 [2, R, CAP]: the candidates' keys and positions, in position order.


@triton.jit
def _sample_threshold_kernel(
    logits_ptr, logits_stride, L, lengths_ptr, K, thr_ptr,
    SAMPLE: tl.constexpr, CAP: tl.constexpr,
):
    """Per row: the candidate threshold key ``thr[row]`` (uint32 bits): about
    ``(K + CAP) / 2`` of its logits are ``>= t``, estimated from ``SAMPLE``
    evenly spaced logits."""
    row = tl.program_id(0)
    n = tl.maximum(tl.minimum(tl.load(lengths_ptr + row), L), 0)
    thr = tl.zeros([], dtype=tl.uint32)  # rows of <= CAP logits: every one is a candidate
    if n > CAP:
        i = tl.arange(0, SAMPLE)
        pos = (i.to(tl.int64) * n) // SAMPLE  # distinct when n >= SAMPLE
        key = float_order_key(tl.load(logits_ptr + row.to(tl.int64) * logits_stride + pos))
        # The sample's r-th largest key, r = SAMPLE * mid / n: about `mid`
        # logits of the row are >= it. Centring the expected count between K
        # and CAP makes both misses (fewer than K, more than CAP: the row falls
        # back to the fused select) ~4.6 sigma events at SAMPLE 2048, n 32k.
        mid = (K + CAP) // 2
        r = tl.minimum(tl.maximum((SAMPLE * mid) // n, 1), SAMPLE)
        # Two digits (16 bits: sign, exponent, 7 mantissa bits) are enough for
        # a threshold: the bin's lowest key is at most ~1% of the value below
        # the r-th largest sample, a few dozen extra candidates at 32k logits.
        prefix, shift, k_rem, take_all = _radix_in_registers(key, key != NEG_INF_KEY, r, 2)
        thr = tl.where(take_all, 0, prefix << shift.to(tl.uint32))
    tl.store(thr_ptr + row, thr.to(tl.int32, bitcast=True))


@triton.jit
def _sample_count_kernel(
    logits_ptr, logits_stride, L, lengths_ptr, thr_ptr, cnt_ptr, NSEG,
    SEG: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per (row, segment): how many of the segment's logits are candidates (key >= thr, not -inf).

    (Every program computing the row's threshold itself, one launch fewer, was
    slower on the H100: 0.129 vs 0.073 ms at 128 x 34k.)"""
    row = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.maximum(tl.minimum(tl.load(lengths_ptr + row), L), 0)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    thr = tl.load(thr_ptr + row).to(tl.uint32, bitcast=True)
    seg_end = tl.minimum(s * SEG + SEG, n)
    cnt = tl.zeros([], dtype=tl.int32)
    start = s * SEG
    while start < seg_end:
        offs = start + tl.arange(0, BLOCK)
        key = float_order_key(tl.load(row_ptr + offs, mask=offs < seg_end, other=0.0))
        m = (offs < seg_end) & (key != NEG_INF_KEY) & (key >= thr)
        cnt += tl.sum(m.to(tl.int32), axis=0)
        start += BLOCK
    tl.store(cnt_ptr + row.to(tl.int64) * NSEG + s, cnt)


@triton.jit
def _sample_compact_kernel(
    logits_ptr, logits_stride, L, lengths_ptr, thr_ptr, cnt_ptr, NSEG, cand_ptr, cand_plane,
    SEG: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, NSEG_P2: tl.constexpr,
):
    """Per (row, segment): write the segment's candidates (key, position) at its
    offset among the row's candidates (exclusive sum over earlier segments), so
    the row's ``cand`` lists them in position order. Rows with more than
    ``CAP`` candidates write nothing (they fall back)."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.maximum(tl.minimum(tl.load(lengths_ptr + row), L), 0)
    sidx = tl.arange(0, NSEG_P2)
    cnts = tl.load(cnt_ptr + row.to(tl.int64) * NSEG + sidx, mask=sidx < NSEG, other=0)
    total = tl.sum(cnts, axis=0)
    base = tl.sum(tl.where(sidx < s, cnts, 0), axis=0)
    mine = tl.sum(tl.where(sidx == s, cnts, 0), axis=0)
    if (total <= CAP) & (mine > 0):
        thr = tl.load(thr_ptr + row).to(tl.uint32, bitcast=True)
        row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
        key_out = cand_ptr + row.to(tl.int64) * CAP
        seg_end = tl.minimum(s * SEG + SEG, n)
        start = s * SEG
        while start < seg_end:
            offs = start + tl.arange(0, BLOCK)
            key = float_order_key(tl.load(row_ptr + offs, mask=offs < seg_end, other=0.0))
            m = (offs < seg_end) & (key != NEG_INF_KEY) & (key >= thr)
            m_i = m.to(tl.int32)
            dst = base + tl.cumsum(m_i, axis=0) - m_i
            tl.store(key_out + dst, key.to(tl.int32, bitcast=True), mask=m)
            tl.store(key_out + cand_plane + dst, offs, mask=m)
            base += tl.sum(m_i, axis=0)
            start += BLOCK


@triton.jit
def _sample_select_kernel(
    logits_ptr, logits_stride, L, lengths_ptr, K, thr_ptr, cnt_ptr, NSEG, cand_ptr, cand_plane,
    bt_ptr, bt_stride, bt_cols, rows_per_table,
    slots_ptr, pos_ptr, out_stride,
    WRITE_SLOTS: tl.constexpr, WRITE_POS: tl.constexpr, PAGE: tl.constexpr,
    CAP: tl.constexpr, NSEG_P2: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per row: the exact top-``K`` of its candidates, held in registers, or the
    fused streaming select of the whole row when the sample missed."""
    row = tl.program_id(0)
    n = tl.maximum(tl.minimum(tl.load(lengths_ptr + row), L), 0)
    thr = tl.load(thr_ptr + row)
    sidx = tl.arange(0, NSEG_P2)
    total = tl.sum(tl.load(cnt_ptr + row.to(tl.int64) * NSEG + sidx, mask=sidx < NSEG, other=0), axis=0)
    table_row = (row // rows_per_table).to(tl.int64)
    out_row = row.to(tl.int64) * out_stride
    # The candidates hold the row's exact top-K (ties included) when there are
    # at least K of them (the K-th largest key is then >= thr), or when thr
    # let every logit through; they fit when there are at most CAP.
    if (total <= CAP) & ((total >= K) | (thr == 0)):
        j = tl.arange(0, CAP)
        m = j < total
        src = cand_ptr + row.to(tl.int64) * CAP + j
        key = tl.load(src, mask=m, other=0).to(tl.uint32, bitcast=True)
        pos = tl.load(src + cand_plane, mask=m, other=0)
        prefix, shift, k_rem, take_all = _radix_in_registers(key, m, K)
        zero = tl.zeros([], dtype=tl.int32)
        n_eq, n_sel = _emit_selected(pos, key, m, take_all, prefix, shift, k_rem, zero, zero, K,
                                     bt_ptr, table_row, bt_stride, bt_cols, slots_ptr, pos_ptr, out_row,
                                     WRITE_SLOTS, WRITE_POS, PAGE)
        _pad_row(slots_ptr, pos_ptr, out_row, (n_sel // BLOCK) * BLOCK, K, n_sel, WRITE_SLOTS, WRITE_POS, BLOCK)
    else:
        _topk_row(logits_ptr + row.to(tl.int64) * logits_stride, n, K, bt_ptr, table_row, bt_stride, bt_cols,
                  slots_ptr, pos_ptr, out_row, WRITE_SLOTS, WRITE_POS, PAGE, BLOCK)


def _check(logits: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits: expected float32 [R, L], got {logits.dtype} {tuple(logits.shape)}")
    R = logits.shape[0]
    if lengths.shape != (R,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths: expected int32 [{R}], got {lengths.dtype} {tuple(lengths.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _launch(logits, lengths, topk, page_table, rows_per_table, slots, positions, block=1024, num_warps=8):
    R, L = logits.shape
    if R == 0:
        return
    dummy = slots if slots is not None else positions
    bt = page_table if page_table is not None else dummy
    _topk_kernel[(R,)](
        logits, logits.stride(0), L,
        lengths.contiguous(), topk,
        bt, bt.stride(0), bt.shape[1] if page_table is not None else 0, rows_per_table,
        slots if slots is not None else dummy, positions if positions is not None else dummy, topk,
        WRITE_SLOTS=slots is not None, WRITE_POS=positions is not None,
        PAGE=PAGE_SIZE, BLOCK=block, num_warps=num_warps,
    )


# Rows of at least this many logits (the row length L of the logits tensor)
# take the sampled kernels under method="auto"; shorter rows the fused one.
# H100 (bench/attention.py, docs/perf.md): 128 rows x ~34k, k 2048, replayed
# from a CUDA graph: sampled 0.073 ms, fused 0.196; 4096 prefill rows x ~32k:
# sampled 1.36 ms, fused 2.94.
SAMPLED_MIN_LEN = 8192


# The sampled kernels' defaults: a 2048-logit sample per row; up to 4096
# candidates (2 x k for DeepSeek-V3.2's k = 2048); streaming passes over
# segments of 2048 logits. H100, 128 rows x ~34k graph-replayed (docs/perf.md):
# seg 2048 0.072 ms, 4096 0.073, 8192 0.085; 4 or 16 warps 0.097 / 0.092.
SAMPLED_DEFAULTS = {"sample": 2048, "cap": 4096, "seg": 2048, "block": 2048, "num_warps": 8}


def sampled_scratch_shapes(R: int, L: int, seg: int, cap: int) -> dict:
    """Shapes of the sampled kernels' scratch for ``R`` rows of ``L`` logits (from the shapes only)."""
    return {"thr": (R,), "seg_cnt": (R, max(1, -(-L // seg))), "cand": (2, R, cap)}


def _launch_sampled(logits, lengths, topk, page_table, rows_per_table, slots, positions,
                    sample=SAMPLED_DEFAULTS["sample"], cap=SAMPLED_DEFAULTS["cap"], seg=SAMPLED_DEFAULTS["seg"],
                    block=SAMPLED_DEFAULTS["block"], num_warps=SAMPLED_DEFAULTS["num_warps"]):
    R, L = logits.shape
    if R == 0:
        return
    for name, v in (("sample", sample), ("cap", cap), ("seg", seg), ("block", block)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if cap < topk:
        raise ValueError(f"cap ({cap}) must be >= topk ({topk}): the candidates must be able to hold the top-k")
    shapes = sampled_scratch_shapes(R, L, seg, cap)
    nseg = shapes["seg_cnt"][1]
    dev = logits.device
    # One allocation (16-byte aligned views); nothing needs an initial value.
    sizes = [math.prod(shapes[name]) for name in ("thr", "seg_cnt", "cand")]
    scratch = torch.empty(sum(-(-n // 4) * 4 for n in sizes), dtype=torch.int32, device=dev)
    parts, o = [], 0
    for name, n in zip(("thr", "seg_cnt", "cand"), sizes):
        parts.append(scratch[o:o + n].view(shapes[name]))
        o += -(-n // 4) * 4
    thr, seg_cnt, cand = parts
    lengths = lengths.contiguous()
    nseg_p2 = max(16, triton.next_power_of_2(nseg))
    blk = min(block, seg)
    _sample_threshold_kernel[(R,)](logits, logits.stride(0), L, lengths, topk, thr,
                                   SAMPLE=sample, CAP=cap, num_warps=num_warps)
    _sample_count_kernel[(R, nseg)](logits, logits.stride(0), L, lengths, thr, seg_cnt, nseg,
                                    SEG=seg, BLOCK=blk, num_warps=num_warps)
    _sample_compact_kernel[(R, nseg)](logits, logits.stride(0), L, lengths, thr, seg_cnt, nseg, cand, R * cap,
                                      SEG=seg, BLOCK=blk, CAP=cap, NSEG_P2=nseg_p2, num_warps=num_warps)
    dummy = slots if slots is not None else positions
    bt = page_table if page_table is not None else dummy
    _sample_select_kernel[(R,)](
        logits, logits.stride(0), L, lengths, topk, thr, seg_cnt, nseg, cand, R * cap,
        bt, bt.stride(0), bt.shape[1] if page_table is not None else 0, rows_per_table,
        slots if slots is not None else dummy, positions if positions is not None else dummy, topk,
        WRITE_SLOTS=slots is not None, WRITE_POS=positions is not None, PAGE=PAGE_SIZE,
        CAP=cap, NSEG_P2=nseg_p2, BLOCK=block, num_warps=num_warps,
    )
    return thr, seg_cnt


def sampled_fallback_rows(thr: torch.Tensor, seg_cnt: torch.Tensor, topk: int, cap: int) -> torch.Tensor:
    """bool ``[R]``: the rows whose sample missed (the select kernel's own test), from
    ``_launch_sampled``'s returned scratch; for tests and benchmarks."""
    total = seg_cnt.sum(1)
    return ~((total <= cap) & ((total >= topk) | (thr == 0)))


def _pick_method(method: str, L: int, R: int) -> str:
    """``method`` of :func:`topk_slots` -> the kernel that runs: ``"fused"`` or ``"sampled"``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    return "sampled" if L >= SAMPLED_MIN_LEN else "fused"


def _check_table(page_table: torch.Tensor, R: int, rows_per_table: int) -> torch.Tensor:
    if page_table.dim() != 2 or page_table.dtype != torch.int32:
        raise ValueError(f"page_table: expected int32 [T, max_pages], got {page_table.dtype} {tuple(page_table.shape)}")
    if rows_per_table < 1 or (R and (R - 1) // rows_per_table >= page_table.shape[0]):
        raise ValueError(f"{R} rows at {rows_per_table} rows per table need more than {page_table.shape[0]} table rows")
    return page_table if page_table.stride(-1) == 1 else page_table.contiguous()


def _select(launch, logits, lengths, topk, page_table, rows_per_table, want_slots, want_positions, **cfg):
    """Check the inputs, allocate the outputs, run ``launch``; returns ``(positions or None, slots or None)``."""
    logits = _check(logits, lengths, topk)
    R = logits.shape[0]
    if want_slots:
        page_table = _check_table(page_table, R, rows_per_table)
    slots = torch.empty(R, topk, dtype=torch.int32, device=logits.device) if want_slots else None
    positions = torch.empty(R, topk, dtype=torch.int32, device=logits.device) if want_positions else None
    launch(logits, lengths, topk, page_table if want_slots else None, rows_per_table, slots, positions, **cfg)
    return positions, slots


def topk_slots(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    page_table: torch.Tensor,
    *,
    rows_per_table: int = 1,
    return_positions: bool = False,
    block: int = 1024,
    num_warps: int = 8,
    method: str = "auto",
):
    """Fused top-k over each row's valid prefix -> FlashMLA sparse indices.

    Args:
        logits: float32 ``[R, L]`` indexer logits (unit inner stride); only
            ``logits[r, :lengths[r]]`` is read.
        lengths: int32 ``[R]`` valid lengths (clamped to ``[0, L]``).
        topk: ``k`` (2048 for DeepSeek-V3.2 / GLM-5).
        page_table: int32 ``[T, max_pages]``; row ``r`` uses table row
            ``r // rows_per_table`` (``rows_per_table = next_n`` for the
            ``B * next_n`` rows of an MTP decode step).
        return_positions: also return the selected positions.
        block, num_warps: launch configuration of the one-program-per-row kernel.
        method: ``"fused"`` (one program per row), ``"sampled"``
            (:func:`topk_slots_sampled` with its defaults) or ``"auto"``:
            sampled for rows of ``>= SAMPLED_MIN_LEN`` logits. Same results,
            bit for bit.

    Returns:
        int32 ``[R, topk]`` slots ``page * 64 + offset`` of the selected tokens,
        in ascending position order, ``-1`` padded (a row with ``length <= topk``
        selects all of its tokens); with ``return_positions``,
        ``(positions int32 [R, topk], slots)`` like the reference ``topk_slots``.
        See the module docstring for the tie rule.
    """
    kernel = _pick_method(method, logits.shape[1] if logits.dim() == 2 else 0, logits.shape[0])
    launch, cfg = _LAUNCHERS[kernel], ({"block": block, "num_warps": num_warps} if kernel == "fused" else {})
    positions, slots = _select(launch, logits, lengths, topk, page_table, rows_per_table, True, return_positions,
                               **cfg)
    return (positions, slots) if return_positions else slots


def topk_positions(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    block: int = 1024,
    num_warps: int = 8,
    method: str = "auto",
) -> torch.Tensor:
    """The same selection without a page table: int32 ``[R, topk]`` positions, ascending, ``-1`` padded.

    For prefill, where FlashMLA's sparse kernel indexes a dequantized workspace
    instead of the paged cache. ``method`` as for :func:`topk_slots`.
    """
    kernel = _pick_method(method, logits.shape[1] if logits.dim() == 2 else 0, logits.shape[0])
    launch, cfg = _LAUNCHERS[kernel], ({"block": block, "num_warps": num_warps} if kernel == "fused" else {})
    return _select(launch, logits, lengths, topk, None, 1, False, True, **cfg)[0]


def topk_slots_sampled(logits, lengths, topk, page_table, *, rows_per_table=1, return_positions=False, **cfg):
    """:func:`topk_slots` on the sampled kernels (module docstring), bit for bit.

    ``cfg`` (defaults ``SAMPLED_DEFAULTS``): ``sample`` logits per row for the
    threshold, ``cap`` candidates at most (``>= topk``), ``seg`` logits per
    program of the two streaming passes, their tile ``block``, ``num_warps``;
    all but ``num_warps`` powers of two. Four launches, no host sync, scratch
    sized from shapes: CUDA-graph capturable.
    """
    positions, slots = _select(_launch_sampled, logits, lengths, topk, page_table, rows_per_table, True,
                               return_positions, **cfg)
    return (positions, slots) if return_positions else slots


def topk_positions_sampled(logits, lengths, topk, **cfg) -> torch.Tensor:
    """:func:`topk_positions` on the sampled kernels (see :func:`topk_slots_sampled`)."""
    return _select(_launch_sampled, logits, lengths, topk, None, 1, False, True, **cfg)[0]


METHODS = ("auto", "fused", "sampled")
_LAUNCHERS = {"fused": _launch, "sampled": _launch_sampled}
