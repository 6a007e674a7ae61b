"""Triton kernels that write tokens into, and read them out of, DeepSeek-V4's fp8 cache pages.

Byte-for-byte partners of the torch reference (``attention/v4_format.py``, ``attention/v4_index_format.py``),
one launch per call and no host read-back (the cuda device's ``GroupedPagedCache`` routes its V4 pages
through them: ``attention.group_cache.v4_page_ops``):

* `write_v4_fp8` / `read_v4_fp8`: the 584-byte V4 token (448 fp8 e4m3 nope values, one UE8M0 scale byte
  per 64 of them, 64 bf16 rope values) in 256-token pages of parts, then scale rows: ``v4_format.write_v4``
  / ``read_v4``;
* `write_v4_index_fp8` / `read_v4_index_fp8`: the fp8 indexer keys (one float32 power-of-two scale a key)
  in 256-token pages of keys, then scales: ``V4IndexFormat.quantize`` / ``dequantize`` placed by
  ``v4_format.write_tokens`` / ``read_tokens``;
* `write_pages` / `read_pages`: whichever of the two a format names.

Pools are uint8 ``[P, fmt.page_bytes]``, each page contiguous, pages ``stride(0)`` bytes apart (one layer's
pages inside a grouped cache's pages: ``GroupedPagedCache``); slots are ``page * 256 + offset``, ``-1`` skipped
on write and read as zeros. Byte offsets are int64. Slots of one write must be distinct (two writers of a
slot race). Inputs must be finite (what torch makes of inf / NaN is not reproduced).

The scale exponent is torch's ``ceil(log2(amax / 448))``. ``log2`` in fp32 rounds ``2^k (1 + 2^-23)`` to
``k`` for ``|k| >= 4``, so torch's ceiling is NOT the exact one there, and neither ``tl.log2`` nor the
exact exponent would reproduce it. The kernels take it from `ceil_log2_thresholds`: per fp32 exponent
field, the smallest mantissa whose torch ``ceil(log2(.))`` (on the pool's device) is one above the power
of two; everything else is integer arithmetic and IEEE ``div_rn`` / multiply (``_bits``' reasons).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..v4_format import _AMAX_FLOOR, FP8_MAX, SCALE_TILE, V4CacheFormat
from ..v4_index_format import V4IndexFormat
from ._bits import e4m3fn_bits_to_f32, f32_to_bf16_bits, f32_to_e4m3fn_bits, load_f32, load_u32_le, store_u32_le
from ._common import check_slots, next_pow2, rows_2d

_PROBE = 256
"""Mantissas above each power of two probed for torch's log2 rounding (a correctly rounded log2 needs < 32,
a 1-ulp one < 64 at every exponent of fp32)."""


@functools.cache
def ceil_log2_thresholds(device: torch.device) -> torch.Tensor:
    """int32 ``[256]``: for each fp32 exponent field ``e``, the smallest mantissa ``m`` such that torch's
    ``ceil(log2(y))`` of ``y = 2^(e-127) (1 + m 2^-23)`` on ``device`` is ``e - 126`` (else ``e - 127``);
    ``_PROBE`` when none below it is (mantissas beyond the probe are taken as above). Built once per device
    with torch's own ``log2`` there (kernel launches only); build it before a CUDA-graph capture."""
    m = torch.arange(_PROBE, dtype=torch.int32, device=device)
    e = torch.arange(256, dtype=torch.int32, device=device)
    y = ((e[:, None] << 23) | m[None, :]).view(torch.float32)
    above = torch.ceil(torch.log2(y)) > (e - 127)[:, None].float()
    first = above.int().argmax(dim=1).int()
    return torch.where(above.any(dim=1), first, _PROBE).contiguous()


@triton.jit
def _ceil_log2(y, thr_ptr):
    """int32 torch ``ceil(log2(y))`` of fp32 ``y`` (normal, > 0) through `ceil_log2_thresholds`."""
    u = y.to(tl.uint32, bitcast=True)
    e = ((u >> 23) & 0xFF).to(tl.int32)
    m = (u & 0x7FFFFF).to(tl.int32)
    return e - 127 + (m >= tl.load(thr_ptr + e)).to(tl.int32)


@triton.jit
def _ue8m0_to_f32(b):
    """int32 / uint32 biased exponent 0..255 -> fp32 ``2^(b - 127)``, exact (0: the subnormal 2^-127;
    255: inf, as torch's ``exp2(128.0)``)."""
    bits = b.to(tl.uint32) << 23
    return tl.where(bits == 0, 0x00400000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _slot_bytes(slots_ptr, t, t_ok, page_stride, PART: tl.constexpr, SB: tl.constexpr, PAGE: tl.constexpr):
    """Rows ``t`` -> (written?, int64 byte offset of the token's part, of its scale row): the page layout
    of ``v4_format.token_bytes_at`` (a page's parts, then its scale rows)."""
    slot = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (slot >= 0)
    page_base = (slot // PAGE) * page_stride
    off = slot % PAGE
    return ok, page_base + off * PART, page_base + PAGE * PART + off * SB


@triton.jit
def _write_v4_kernel(
    pool_ptr, page_stride, slots_ptr, n_tokens, x_ptr, x_stride, thr_ptr,
    NOPE: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr, NS: tl.constexpr, NS_P2: tl.constexpr,
    SB: tl.constexpr, SB_P2: tl.constexpr, PART: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, X_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program quantizes BLOCK_T tokens; the nope values are viewed [BLOCK_T, NS_P2 tiles, TILE] so each
    # tile's amax is one reduction (masked lanes load 0, which no |x| max notices: quantize_v4's zero padding).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    ok, part, scale_row = _slot_bytes(slots_ptr, t, t_ok, page_stride, PART, SB, PAGE)
    x_row = x_ptr + t.to(tl.int64) * x_stride

    tile = tl.arange(0, NS_P2)
    col = tile[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]
    m3 = ok[:, None, None] & (col < NOPE)
    x = load_f32(x_row[:, None, None] + col, m3, X_BF16)
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), AMAX_FLOOR)
    exp = tl.minimum(tl.maximum(_ceil_log2(tl.math.div_rn(amax, FP8_MAX), thr_ptr), -127), 127)
    # Dividing by a power of two, as torch does (a multiply by 2^-exp could differ on fp32 subnormals).
    q = tl.math.div_rn(x, _ue8m0_to_f32(exp + 127)[:, :, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(pool_ptr + part[:, None, None] + col, f32_to_e4m3fn_bits(q).to(tl.uint8), mask=m3)

    tl.store(pool_ptr + scale_row[:, None] + tile[None, :], (exp + 127).to(tl.uint8),
             mask=ok[:, None] & (tile[None, :] < NS))
    pad = tl.arange(0, SB_P2)
    # The scale row's padding bytes are written as zeros, as quantize_v4's zero-filled scale rows are.
    tl.store(pool_ptr + scale_row[:, None] + pad[None, :], tl.zeros([BLOCK_T, SB_P2], tl.uint8),
             mask=ok[:, None] & (pad[None, :] >= NS) & (pad[None, :] < SB))

    d = tl.arange(0, ROPE_P2)
    r_ok = ok[:, None] & (d[None, :] < ROPE)
    r_ptrs = x_row[:, None] + NOPE + d[None, :]
    if X_BF16:
        bits = tl.load(r_ptrs, mask=r_ok, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        bits = f32_to_bf16_bits(tl.load(r_ptrs, mask=r_ok, other=0.0).to(tl.float32))
    dst = pool_ptr + part[:, None] + NOPE + 2 * d[None, :]
    tl.store(dst, (bits & 0xFF).to(tl.uint8), mask=r_ok)
    tl.store(dst + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=r_ok)


@triton.jit
def _read_v4_kernel(
    pool_ptr, page_stride, slots_ptr, n_tokens, out_ptr, out_stride,
    NOPE: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr, NS: tl.constexpr, NS_P2: tl.constexpr,
    SB: tl.constexpr, PART: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    ok, part, scale_row = _slot_bytes(slots_ptr, t, t_ok, page_stride, PART, SB, PAGE)
    out_row = out_ptr + t.to(tl.int64) * out_stride

    tile = tl.arange(0, NS_P2)
    col = tile[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]
    in_nope = col < NOPE
    fp8 = tl.load(pool_ptr + part[:, None, None] + col, mask=ok[:, None, None] & in_nope, other=0)
    sb = tl.load(pool_ptr + scale_row[:, None] + tile[None, :], mask=ok[:, None] & (tile[None, :] < NS), other=127)
    # fp8 -> fp32 and 2^(b - 127) are exact; the product is one IEEE multiply, as dequantize_v4's.
    val = e4m3fn_bits_to_f32(fp8.to(tl.uint32)) * _ue8m0_to_f32(sb.to(tl.uint32))[:, :, None]
    # where, not the masked load's zeros alone: read_v4 gives +0.0 for a -1 slot.
    val = tl.where(ok[:, None, None], val, 0.0)
    tl.store(out_row[:, None, None] + col, val, mask=t_ok[:, None, None] & in_nope)

    d = tl.arange(0, ROPE_P2)
    r_ok = ok[:, None] & (d[None, :] < ROPE)
    src = pool_ptr + part[:, None] + NOPE + 2 * d[None, :]
    lo = tl.load(src, mask=r_ok, other=0).to(tl.uint32)
    hi = tl.load(src + 1, mask=r_ok, other=0).to(tl.uint32)
    rope = ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True)  # bf16 -> fp32, exact
    rope = tl.where(r_ok, rope, 0.0)
    tl.store(out_row[:, None] + NOPE + d[None, :], rope, mask=t_ok[:, None] & (d[None, :] < ROPE))


@triton.jit
def _write_index_kernel(
    pool_ptr, page_stride, slots_ptr, n_tokens, x_ptr, x_stride, thr_ptr,
    HD: tl.constexpr, HD_P2: tl.constexpr, PAGE: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, X_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    ok, part, scale_at = _slot_bytes(slots_ptr, t, t_ok, page_stride, HD, 4, PAGE)
    d = tl.arange(0, HD_P2)
    m2 = ok[:, None] & (d[None, :] < HD)
    x = load_f32(x_ptr + t.to(tl.int64)[:, None] * x_stride + d[None, :], m2, X_BF16)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    # No clamp below (amax >= 1e-4 keeps the exponent >= -22); 128 only for an infinite amax (inf scale).
    exp = tl.minimum(_ceil_log2(tl.math.div_rn(amax, FP8_MAX), thr_ptr), 128)
    scale = _ue8m0_to_f32(exp + 127)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(pool_ptr + part[:, None] + d[None, :], f32_to_e4m3fn_bits(q).to(tl.uint8), mask=m2)
    store_u32_le(pool_ptr + scale_at, scale.to(tl.uint32, bitcast=True), ok)


@triton.jit
def _read_index_kernel(
    pool_ptr, page_stride, slots_ptr, n_tokens, out_ptr, out_stride,
    HD: tl.constexpr, HD_P2: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    ok, part, scale_at = _slot_bytes(slots_ptr, t, t_ok, page_stride, HD, 4, PAGE)
    d = tl.arange(0, HD_P2)
    in_d = d[None, :] < HD
    fp8 = tl.load(pool_ptr + part[:, None] + d[None, :], mask=ok[:, None] & in_d, other=0)
    scale = load_u32_le(pool_ptr + scale_at, ok).to(tl.float32, bitcast=True)
    val = tl.where(ok[:, None], e4m3fn_bits_to_f32(fp8.to(tl.uint32)) * scale[:, None], 0.0)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * out_stride + d[None, :], val, mask=t_ok[:, None] & in_d)


# -- host wrappers ----------------------------------------------------------------------------------


def pool_page_stride(pool: torch.Tensor, fmt: V4CacheFormat | V4IndexFormat) -> int:
    """Page stride in bytes of a pool uint8 ``[P, fmt.page_bytes]`` whose pages are each contiguous and
    at least ``page_bytes`` apart (``v4_format.kernel_view``'s rule)."""
    if (pool.dim() != 2 or pool.dtype != torch.uint8 or pool.shape[1] != fmt.page_bytes or pool.stride(1) != 1
            or (pool.shape[0] > 1 and pool.stride(0) < fmt.page_bytes)):
        raise ValueError(f"pool must be uint8 [P, {fmt.page_bytes}], each page contiguous, got "
                         f"{pool.dtype} {tuple(pool.shape)} strides {pool.stride()}")
    return pool.stride(0) if pool.shape[0] > 1 else fmt.page_bytes


def _read_out(pool: torch.Tensor, n: int, width: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(n, width, dtype=torch.float32, device=pool.device)
    if out.dtype != torch.float32 or tuple(out.shape) != (n, width) or out.stride(-1) != 1:
        raise ValueError(f"out: expected float32 [{n}, {width}] with unit inner stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    return out


def write_v4_fp8(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: V4CacheFormat, *,
                 block_t: int = 4, num_warps: int = 4) -> None:
    """Quantize tokens x float32 / bfloat16 / float16 ``[n, nope + rope]`` into ``pool`` uint8
    ``[P, fmt.page_bytes]`` (in place) at ``slots`` int32 / int64 ``[n]`` (``-1`` skipped): the bytes
    ``v4_format.write_v4`` writes (parts, scale rows with their zero padding; page padding untouched)."""
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    x = rows_2d(x, n, fmt.head_dim, "x")
    page_stride = pool_page_stride(pool, fmt)
    if n == 0:
        return
    _write_v4_kernel[(triton.cdiv(n, block_t),)](
        pool, page_stride, slots, n, x, x.stride(0), ceil_log2_thresholds(pool.device),
        NOPE=fmt.nope_dim, ROPE=fmt.rope_dim, ROPE_P2=next_pow2(fmt.rope_dim), NS=fmt.n_scales,
        NS_P2=next_pow2(fmt.n_scales), SB=fmt.scale_bytes, SB_P2=next_pow2(fmt.scale_bytes),
        PART=fmt.part_bytes, PAGE=fmt.page_tokens, TILE=SCALE_TILE, AMAX_FLOOR=_AMAX_FLOOR, FP8_MAX=FP8_MAX,
        X_BF16=x.dtype == torch.bfloat16, BLOCK_T=block_t, num_warps=num_warps,
    )


def read_v4_fp8(pool: torch.Tensor, slots: torch.Tensor, fmt: V4CacheFormat, out: torch.Tensor | None = None, *,
                block_t: int = 4, num_warps: int = 4) -> torch.Tensor:
    """Dequantized tokens float32 ``[n, nope + rope]`` at ``slots`` ``[n]`` of ``pool`` (``-1`` -> zeros):
    equal to ``v4_format.read_v4``. ``out``: an optional float32 ``[n, nope + rope]`` to fill."""
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    page_stride = pool_page_stride(pool, fmt)
    out = _read_out(pool, n, fmt.head_dim, out)
    if n:
        _read_v4_kernel[(triton.cdiv(n, block_t),)](
            pool, page_stride, slots, n, out, out.stride(0),
            NOPE=fmt.nope_dim, ROPE=fmt.rope_dim, ROPE_P2=next_pow2(fmt.rope_dim), NS=fmt.n_scales,
            NS_P2=next_pow2(fmt.n_scales), SB=fmt.scale_bytes, PART=fmt.part_bytes, PAGE=fmt.page_tokens,
            TILE=SCALE_TILE, BLOCK_T=block_t, num_warps=num_warps,
        )
    return out


def write_v4_index_fp8(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, fmt: V4IndexFormat, *,
                       block_t: int = 16, num_warps: int = 4) -> None:
    """Quantize indexer keys k float ``[n, head_dim]`` into ``pool`` uint8 ``[P, fmt.page_bytes]`` at ``slots``
    (``-1`` skipped): the bytes ``v4_format.write_tokens`` writes with ``V4IndexFormat``."""
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    k = rows_2d(k, n, fmt.head_dim, "k")
    page_stride = pool_page_stride(pool, fmt)
    if n == 0:
        return
    _write_index_kernel[(triton.cdiv(n, block_t),)](
        pool, page_stride, slots, n, k, k.stride(0), ceil_log2_thresholds(pool.device),
        HD=fmt.head_dim, HD_P2=next_pow2(fmt.head_dim), PAGE=fmt.page_tokens, AMAX_FLOOR=_AMAX_FLOOR,
        FP8_MAX=FP8_MAX, X_BF16=k.dtype == torch.bfloat16, BLOCK_T=block_t, num_warps=num_warps,
    )


def read_v4_index_fp8(pool: torch.Tensor, slots: torch.Tensor, fmt: V4IndexFormat,
                      out: torch.Tensor | None = None, *, block_t: int = 16, num_warps: int = 4) -> torch.Tensor:
    """Dequantized indexer keys float32 ``[n, head_dim]`` at ``slots`` (``-1`` -> zeros): equal to
    ``v4_format.read_tokens`` with ``V4IndexFormat``."""
    slots = check_slots(slots, "slots")
    n = slots.shape[0]
    page_stride = pool_page_stride(pool, fmt)
    out = _read_out(pool, n, fmt.head_dim, out)
    if n:
        _read_index_kernel[(triton.cdiv(n, block_t),)](
            pool, page_stride, slots, n, out, out.stride(0),
            HD=fmt.head_dim, HD_P2=next_pow2(fmt.head_dim), PAGE=fmt.page_tokens, BLOCK_T=block_t,
            num_warps=num_warps,
        )
    return out


def write_pages(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: V4CacheFormat | V4IndexFormat) -> None:
    """`write_v4_fp8` or `write_v4_index_fp8`, as ``fmt`` is."""
    if isinstance(fmt, V4IndexFormat):
        write_v4_index_fp8(pool, slots, x, fmt)
    else:
        write_v4_fp8(pool, slots, x, fmt)


def read_pages(pool: torch.Tensor, slots: torch.Tensor, fmt: V4CacheFormat | V4IndexFormat) -> torch.Tensor:
    """`read_v4_fp8` or `read_v4_index_fp8`, as ``fmt`` is."""
    if isinstance(fmt, V4IndexFormat):
        return read_v4_index_fp8(pool, slots, fmt)
    return read_v4_fp8(pool, slots, fmt)
