"""Triton kernels that write new tokens into the fp8 paged caches.

Both kernels are bit-identical to the torch reference quantizers in
``attention/formats.py`` (``quantize_mla_fp8`` and ``quantize_indexer_fp8`` +
``pack_indexer_page``): the same fp32 ``amax / 448`` scales, IEEE division,
clamp to +-448 and round-to-nearest-even to float8_e4m3fn / bfloat16.

Tokens are addressed by slot ``page * 64 + offset``; a negative slot is skipped
(padding rows of a CUDA-graph batch). Byte offsets are computed in int64: a
pool of one layer can exceed 2^31 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import FP8_TILE, PAGE_SIZE, IndexerFp8Format, MlaFp8Format
from ._bits import f32_to_bf16_bits, f32_to_e4m3fn_bits, load_f32, store_u32_le
from ._common import check_slots, next_pow2, page_pool_stride, pool_strides, rows_2d


@triton.jit
def _write_mla_fp8_kernel(
    pool_ptr, page_stride, token_stride,
    slots_ptr, n_tokens,
    latent_ptr, latent_stride,
    rope_ptr, rope_stride,
    R: tl.constexpr, D: tl.constexpr, NT: tl.constexpr, NT_P2: tl.constexpr, D_P2: tl.constexpr,
    TILE: tl.constexpr, PAGE: tl.constexpr,
    LATENT_BF16: tl.constexpr, ROPE_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program quantizes BLOCK_T tokens; the latent is viewed as
    # [BLOCK_T, NT_P2 tiles, TILE] so the per-tile amax is one reduction.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    slot = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (slot >= 0)
    base = (slot // PAGE) * page_stride + (slot % PAGE) * token_stride  # int64 byte offset
    t64 = t.to(tl.int64)

    tile = tl.arange(0, NT_P2)
    col = tile[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]  # [1, NT_P2, TILE]
    m3 = ok[:, None, None] & (col < R)
    x = load_f32(latent_ptr + t64[:, None, None] * latent_stride + col, m3, LATENT_BF16)
    # Masked lanes are 0 and never change a max of |x| (the last tile may be narrower).
    amax = tl.max(tl.abs(x), axis=2)
    scale = tl.math.div_rn(amax, 448.0)
    # An all-zero tile stores scale 0 and divides by 1 (0/0 would be NaN).
    divisor = tl.where(amax > 0, scale, 1.0)
    q = tl.math.div_rn(x, divisor[:, :, None])
    # amax / (amax / 448) may exceed 448 by an ulp; e4m3fn has no inf to absorb it.
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(pool_ptr + base[:, None, None] + col, f32_to_e4m3fn_bits(q).to(tl.uint8), mask=m3)

    s_ok = ok[:, None] & (tile[None, :] < NT)
    store_u32_le(pool_ptr + base[:, None] + R + 4 * tile[None, :], scale.to(tl.uint32, bitcast=True), s_ok)

    if D > 0:
        d = tl.arange(0, D_P2)
        r_ok = ok[:, None] & (d[None, :] < D)
        r_ptrs = rope_ptr + t64[:, None] * rope_stride + d[None, :]
        if ROPE_BF16:
            bits = tl.load(r_ptrs, mask=r_ok, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            bits = f32_to_bf16_bits(tl.load(r_ptrs, mask=r_ok, other=0.0).to(tl.float32))
        # The rope offset R + 4 * NT is only 2-byte aligned in general: store bytes.
        dst = pool_ptr + base[:, None] + (R + 4 * NT) + 2 * d[None, :]
        tl.store(dst, (bits & 0xFF).to(tl.uint8), mask=r_ok)
        tl.store(dst + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=r_ok)


def write_mla_fp8(
    pool: torch.Tensor,
    slots: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    fmt: MlaFp8Format | None = None,
    *,
    block_t: int = 8,
    num_warps: int = 4,
) -> None:
    """Quantize ``n`` tokens and write them into the fp8 MLA cache, in place.

    Args:
        pool: uint8 ``[num_pages, 64, B]`` or FlashMLA's ``[num_pages, 64, 1, B]``
            view with ``B = fmt.bytes_per_token`` (656 for 512/64); a strided
            slice of a bigger allocation is fine as long as each token's bytes
            are contiguous.
        slots: int32/int64 ``[n]``, ``page * 64 + offset``; negative = skip.
        latent: float32/bfloat16/float16 ``[n, kv_lora_rank]`` (normed latent).
        rope: float32/bfloat16/float16 ``[n, rope_dim]`` (stored as bfloat16).
        fmt: geometry; derived from the shapes when omitted.

    Each written token is byte-identical to ``formats.quantize_mla_fp8``.
    Slots must be distinct (two writers of one slot race).
    """
    if latent.dim() != 2 or rope.dim() != 2:
        raise ValueError(f"expected latent [n, r] and rope [n, d], got {tuple(latent.shape)}, {tuple(rope.shape)}")
    if fmt is None:
        fmt = MlaFp8Format(latent.shape[1], rope.shape[1])
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    latent = rows_2d(latent, n, fmt.kv_lora_rank, "latent")
    rope = rows_2d(rope, n, fmt.rope_dim, "rope")
    page_stride, token_stride = pool_strides(pool, fmt.bytes_per_token, "pool")
    if n == 0:
        return
    grid = (triton.cdiv(n, block_t),)
    _write_mla_fp8_kernel[grid](
        pool, page_stride, token_stride,
        slots, n,
        latent, latent.stride(0),
        # A [n, 0] rope may have no storage: hand the kernel any valid pointer.
        rope if fmt.rope_dim else latent, rope.stride(0) if fmt.rope_dim else 0,
        R=fmt.kv_lora_rank, D=fmt.rope_dim, NT=fmt.n_tiles, NT_P2=next_pow2(fmt.n_tiles),
        D_P2=next_pow2(fmt.rope_dim), TILE=FP8_TILE, PAGE=PAGE_SIZE,
        LATENT_BF16=latent.dtype == torch.bfloat16, ROPE_BF16=rope.dtype == torch.bfloat16,
        BLOCK_T=block_t, num_warps=num_warps,
    )


@triton.jit
def _write_indexer_fp8_kernel(
    pool_ptr, page_stride,
    slots_ptr, n_tokens,
    k_ptr, k_stride,
    HD: tl.constexpr, HD_P2: tl.constexpr, PAGE: tl.constexpr,
    K_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    slot = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (slot >= 0)
    page = slot // PAGE
    off = slot % PAGE
    page_base = page * page_stride  # int64

    d = tl.arange(0, HD_P2)
    m2 = ok[:, None] & (d[None, :] < HD)
    x = load_f32(k_ptr + t.to(tl.int64)[:, None] * k_stride + d[None, :], m2, K_BF16)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, 448.0)
    divisor = tl.where(amax > 0, scale, 1.0)
    q = tl.math.div_rn(x, divisor[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    # Page layout: 64 tokens x HD fp8 bytes (token-major), then 64 fp32 scales.
    tl.store(pool_ptr + page_base[:, None] + off[:, None] * HD + d[None, :],
             f32_to_e4m3fn_bits(q).to(tl.uint8), mask=m2)
    store_u32_le(pool_ptr + page_base + PAGE * HD + 4 * off, scale.to(tl.uint32, bitcast=True), ok)


def write_indexer_fp8(
    pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    fmt: IndexerFp8Format | None = None,
    *,
    block_t: int = 16,
    num_warps: int = 4,
) -> None:
    """Quantize ``n`` indexer keys and write them into the fp8 indexer cache, in place.

    Args:
        pool: uint8 ``[num_pages, 64 * (D + 4)]`` or DeepGEMM's
            ``[num_pages, 64, 1, D + 4]`` view (8448-byte pages for D = 128).
        slots: int32/int64 ``[n]``, ``page * 64 + offset``; negative = skip.
        k: float32/bfloat16/float16 ``[n, D]``.

    Each token's D fp8 bytes and fp32 scale are byte-identical to
    ``formats.quantize_indexer_fp8`` placed by ``formats.pack_indexer_page``.
    """
    if k.dim() != 2:
        raise ValueError(f"expected k [n, D], got {tuple(k.shape)}")
    if fmt is None:
        fmt = IndexerFp8Format(k.shape[1])
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    k = rows_2d(k, n, fmt.head_dim, "k")
    page_stride = page_pool_stride(pool, fmt.bytes_per_page, "pool")
    if n == 0:
        return
    grid = (triton.cdiv(n, block_t),)
    _write_indexer_fp8_kernel[grid](
        pool, page_stride, slots, n, k, k.stride(0),
        HD=fmt.head_dim, HD_P2=next_pow2(fmt.head_dim), PAGE=PAGE_SIZE,
        K_BF16=k.dtype == torch.bfloat16, BLOCK_T=block_t, num_warps=num_warps,
    )
