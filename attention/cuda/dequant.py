"""Triton kernels that read cached tokens back out of the fp8 paged caches.

``dequantize_mla_fp8`` gathers arbitrary slots (or whole pages) of the fp8 MLA
cache into a bfloat16 ``[n, kv_lora_rank + rope_dim]`` workspace: the layout
``flash_mla_sparse_fwd`` takes as its ``kv``, which is how prefill attends over
cached prefix pages. ``gather_indexer_fp8`` copies indexer keys out of their
pages into the contiguous ``(k_fp8 [n, D], scale [n])`` pair that DeepGEMM's
ragged ``fp8_mqa_logits`` takes.

All byte offsets are int64: one layer's pool can exceed 2^31 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import FP8_TILE, PAGE_SIZE, IndexerFp8Format, MlaFp8Format
from ._bits import e4m3fn_bits_to_f32, f32_to_bf16_bits, load_u32_le
from ._common import check_slots, next_pow2, page_pool_stride, pool_strides


@triton.jit
def _dequant_mla_fp8_kernel(
    pool_ptr, page_stride, token_stride,
    slots_ptr, n_tokens,
    out_ptr, out_stride,
    R: tl.constexpr, D: tl.constexpr, NT: tl.constexpr, NT_P2: tl.constexpr, D_P2: tl.constexpr,
    TILE: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    slot = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    # Invalid slots read as all-zero bytes -> scale 0, value 0, rope 0: the
    # workspace row is written with zeros, never left stale.
    ok = t_ok & (slot >= 0)
    base = (slot // PAGE) * page_stride + (slot % PAGE) * token_stride  # int64
    out_row = out_ptr + t.to(tl.int64) * out_stride

    tile = tl.arange(0, NT_P2)
    col = tile[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]  # [1, NT_P2, TILE]
    in_r = col < R
    fp8 = tl.load(pool_ptr + base[:, None, None] + col, mask=ok[:, None, None] & in_r, other=0)
    s_ok = ok[:, None] & (tile[None, :] < NT)
    scale = load_u32_le(pool_ptr + base[:, None] + R + 4 * tile[None, :], s_ok).to(tl.float32, bitcast=True)
    # fp8 -> fp32 is exact and the product is one IEEE multiply, as in the
    # reference; only the final bf16 rounding (nearest-even) is added.
    val = e4m3fn_bits_to_f32(fp8.to(tl.uint32)) * scale[:, :, None]
    bits = f32_to_bf16_bits(val).to(tl.uint16).to(tl.int16, bitcast=True)
    tl.store(out_row[:, None, None] + col, bits, mask=t_ok[:, None, None] & in_r)

    if D > 0:
        d = tl.arange(0, D_P2)
        r_ok = ok[:, None] & (d[None, :] < D)
        src = pool_ptr + base[:, None] + (R + 4 * NT) + 2 * d[None, :]
        lo = tl.load(src, mask=r_ok, other=0).to(tl.uint16)
        hi = tl.load(src + 1, mask=r_ok, other=0).to(tl.uint16)
        rope = (lo | (hi << 8)).to(tl.int16, bitcast=True)  # the stored bf16, verbatim
        tl.store(out_row[:, None] + R + d[None, :], rope, mask=t_ok[:, None] & (d[None, :] < D))


def dequantize_mla_fp8(
    pool: torch.Tensor,
    slots: torch.Tensor,
    fmt: MlaFp8Format,
    out: torch.Tensor | None = None,
    *,
    block_t: int = 8,
    num_warps: int = 4,
) -> torch.Tensor:
    """Gather + dequantize cached MLA tokens into a bfloat16 workspace.

    Args:
        pool: uint8 ``[num_pages, 64, B]`` or ``[num_pages, 64, 1, B]``,
            ``B = fmt.bytes_per_token``.
        slots: int32/int64 ``[n]``, ``page * 64 + offset``; negative -> a zero row.
        fmt: the cache geometry.
        out: optional bfloat16 ``[n, r + d]`` (row stride free, unit inner
            stride), e.g. a slice of a persistent prefill workspace.

    Returns:
        bfloat16 ``[n, r + d]``: latent = ``bf16(fp8 * scale)`` (the reference's
        fp32 dequantization rounded to nearest-even), rope = the stored bf16
        bits. Equal bit for bit to ``formats.dequantize_mla_fp8(...)`` cast to bf16.
    """
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    width = fmt.kv_lora_rank + fmt.rope_dim
    page_stride, token_stride = pool_strides(pool, fmt.bytes_per_token, "pool")
    if out is None:
        out = torch.empty(n, width, dtype=torch.bfloat16, device=pool.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (n, width) or out.stride(-1) != 1:
        raise ValueError(f"out: expected bfloat16 [{n}, {width}] with unit inner stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if n == 0:
        return out
    grid = (triton.cdiv(n, block_t),)
    _dequant_mla_fp8_kernel[grid](
        pool, page_stride, token_stride, slots, n,
        out.view(torch.int16), out.stride(0),
        R=fmt.kv_lora_rank, D=fmt.rope_dim, NT=fmt.n_tiles, NT_P2=next_pow2(fmt.n_tiles),
        D_P2=next_pow2(fmt.rope_dim), TILE=FP8_TILE, PAGE=PAGE_SIZE, BLOCK_T=block_t,
        num_warps=num_warps,
    )
    return out


def page_slots(page_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[p * 64]`` slots of whole pages, in order; a negative page id gives 64 ``-1`` slots."""
    if page_ids.dim() != 1:
        raise ValueError(f"expected page ids [p], got {tuple(page_ids.shape)}")
    pages = page_ids.to(torch.int64)[:, None]
    slots = pages * PAGE_SIZE + torch.arange(PAGE_SIZE, device=page_ids.device)
    return torch.where(pages >= 0, slots, -1).reshape(-1)


def dequantize_mla_fp8_pages(
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    fmt: MlaFp8Format,
    out: torch.Tensor | None = None,
    **kw,
) -> torch.Tensor:
    """:func:`dequantize_mla_fp8` of whole pages: bfloat16 ``[len(page_ids) * 64, r + d]``.

    Row ``i * 64 + j`` is token ``j`` of page ``page_ids[i]`` (so a request's
    pages in block-table order give its tokens in sequence order).
    """
    return dequantize_mla_fp8(pool, page_slots(page_ids), fmt, out, **kw)


@triton.jit
def _gather_indexer_fp8_kernel(
    pool_ptr, page_stride,
    slots_ptr, n_tokens,
    k_out_ptr, k_out_stride, scale_out_ptr,
    HD: tl.constexpr, HD_P2: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    slot = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (slot >= 0)
    page_base = (slot // PAGE) * page_stride
    off = slot % PAGE
    d = tl.arange(0, HD_P2)
    in_d = d[None, :] < HD
    k = tl.load(pool_ptr + page_base[:, None] + off[:, None] * HD + d[None, :], mask=ok[:, None] & in_d, other=0)
    tl.store(k_out_ptr + t.to(tl.int64)[:, None] * k_out_stride + d[None, :], k, mask=t_ok[:, None] & in_d)
    scale = load_u32_le(pool_ptr + page_base + PAGE * HD + 4 * off, ok)
    tl.store(scale_out_ptr + t, scale.to(tl.int32, bitcast=True), mask=t_ok)


def gather_indexer_fp8(
    pool: torch.Tensor,
    slots: torch.Tensor,
    fmt: IndexerFp8Format,
    *,
    block_t: int = 16,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy cached indexer keys out of their pages (no dequantization).

    Args:
        pool: uint8 ``[num_pages, 64 * (D + 4)]`` or ``[num_pages, 64, 1, D + 4]``.
        slots: int32/int64 ``[n]``; negative -> zero key, scale 0.

    Returns:
        ``(k_fp8 float8_e4m3fn [n, D], scale float32 [n])``, the bytes exactly
        as stored (``formats.unpack_indexer_page`` of the same tokens).
    """
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    page_stride = page_pool_stride(pool, fmt.bytes_per_page, "pool")
    k_out = torch.empty(n, fmt.head_dim, dtype=torch.uint8, device=pool.device)
    scale = torch.empty(n, dtype=torch.float32, device=pool.device)
    if n:
        _gather_indexer_fp8_kernel[(triton.cdiv(n, block_t),)](
            pool, page_stride, slots, n, k_out, k_out.stride(0), scale.view(torch.int32),
            HD=fmt.head_dim, HD_P2=next_pow2(fmt.head_dim), PAGE=PAGE_SIZE, BLOCK_T=block_t,
            num_warps=num_warps,
        )
    return k_out.view(torch.float8_e4m3fn), scale
