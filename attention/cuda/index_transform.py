"""Triton kernel: per-query top-k token positions -> FlashMLA sparse indices.

A position is a token's index within its request (``0 .. context_len - 1``);
FlashMLA's sparse decode wants the cache slot ``page_id * 64 + offset``, found
through the request's block table, with ``-1`` for "no token".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import PAGE_SIZE


@triton.jit
def _positions_to_slots_kernel(
    pos_ptr, pos_stride, out_ptr, out_stride, K,
    bt_ptr, bt_stride, bt_cols, rows_per_table,
    lengths_ptr,
    HAS_LENGTHS: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j_ok = j < K
    pos = tl.load(pos_ptr + row.to(tl.int64) * pos_stride + j, mask=j_ok, other=-1).to(tl.int64)
    valid = j_ok & (pos >= 0)
    if HAS_LENGTHS:
        valid = valid & (pos < tl.load(lengths_ptr + row))
    page_idx = pos // PAGE
    # A position past the block table's width has no page: invalid, never an OOB read.
    valid = valid & (page_idx < bt_cols)
    table_row = (row // rows_per_table).to(tl.int64)
    page = tl.load(bt_ptr + table_row * bt_stride + page_idx, mask=valid, other=-1)
    slot = tl.where(valid & (page >= 0), page * PAGE + (pos % PAGE).to(tl.int32), -1)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + j, slot.to(tl.int32), mask=j_ok)


def positions_to_slots(
    positions: torch.Tensor,
    page_table: torch.Tensor,
    *,
    rows_per_table: int = 1,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:
    """Translate top-k positions into FlashMLA indices through the page table.

    Args:
        positions: int32/int64 ``[R, K]`` token positions; negative = invalid.
        page_table: int32 ``[T, max_pages]``; row ``r`` of ``positions`` uses
            table row ``r // rows_per_table`` (``rows_per_table = next_n`` lets
            the ``B * next_n`` decode rows share their request's row instead of
            a repeated table). A negative page id is invalid.
        lengths: optional int32 ``[R]``; positions ``>= lengths[r]`` are invalid.
        out: optional int32 ``[R, K]`` (unit inner stride) to write into.

    Returns:
        int32 ``[R, K]``: ``page_table[r // rows_per_table, p // 64] * 64 + p % 64``,
        or ``-1`` where the position, its page or its table column is invalid.
    """
    if positions.dim() != 2 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: expected int32/int64 [R, K], got {positions.dtype} {tuple(positions.shape)}")
    if page_table.dim() != 2 or page_table.dtype != torch.int32:
        raise ValueError(f"page_table: expected int32 [T, max_pages], got {page_table.dtype} {tuple(page_table.shape)}")
    R, K = positions.shape
    if rows_per_table < 1 or (R and (R - 1) // rows_per_table >= page_table.shape[0]):
        raise ValueError(f"{R} rows at {rows_per_table} rows per table need more than {page_table.shape[0]} table rows")
    if lengths is not None and (lengths.shape != (R,) or lengths.dtype != torch.int32):
        raise ValueError(f"lengths: expected int32 [{R}], got {lengths.dtype} {tuple(lengths.shape)}")
    positions = positions if positions.stride(-1) == 1 else positions.contiguous()
    page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    if out is None:
        out = torch.empty(R, K, dtype=torch.int32, device=positions.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (R, K) or out.stride(-1) != 1:
        raise ValueError(f"out: expected int32 [{R}, {K}], got {out.dtype} {tuple(out.shape)}")
    if R == 0 or K == 0:
        return out
    grid = (R, triton.cdiv(K, block))
    _positions_to_slots_kernel[grid](
        positions, positions.stride(0), out, out.stride(0), K,
        page_table, page_table.stride(0), page_table.shape[1], rows_per_table,
        lengths if lengths is not None else positions,
        HAS_LENGTHS=lengths is not None, PAGE=PAGE_SIZE, BLOCK=block, num_warps=num_warps,
    )
    return out
