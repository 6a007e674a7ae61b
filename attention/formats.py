"""Byte formats of every paged cache (DESIGN.md, "Byte formats").

The page geometry here is the single source of truth: the model runner, the
page pool and the NIXL transfer plan all call these helpers instead of doing
their own arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_SIZE = 64
"""Tokens per page, shared by every cache (MLA latent, indexer keys, state pages)."""


def pages_for_tokens(num_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``.

    Prefill and decode both call this with the *prompt* length when they agree
    on the pages of a transfer; computing it from prompt + sampled token is a
    known cross-engine off-by-one.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // page_size)


# --------------------------------------------------------------------------
# Shared fp8 constants
# --------------------------------------------------------------------------

FP8_DTYPE = torch.float8_e4m3fn
"""Element type of every fp8 cache (OCP e4m3 "fn": no inf, max finite 448)."""

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; a scale is ``amax / FP8_MAX``."""

FP8_TILE = 128
"""Latent elements sharing one fp32 scale in the fp8 MLA cache."""

_SCALE_BYTES = 4  # one float32 scale
_ROPE_BYTES = 2  # one bfloat16 rope element


def _check_dim(name: str, value: object, *, allow_zero: bool = False) -> int:
    # bool is an int subclass; True would silently mean "1".
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _scale_from_amax(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, divisor)`` for an fp32 ``amax`` of any shape.

    ``scale = amax / 448`` is what is stored. ``divisor`` is what the values are
    divided by: the scale itself, except 1 where amax == 0 so that an all-zero
    tile / token quantizes to zeros (0 / 0 would be NaN). Its stored scale is 0,
    so it dequantizes to exact zeros.
    """
    scale = amax / FP8_MAX
    divisor = torch.where(amax > 0, scale, torch.ones_like(scale))
    return scale, divisor


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # The largest element of a tile divides to 448 * (1 +- 2^-24); clamp so a
    # one-ulp overshoot can never turn into NaN (e4m3fn has no inf).
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _float_bytes(x: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes of a contiguous float tensor ``[..., k]`` -> uint8 ``[..., k * itemsize]``."""
    return x.contiguous().view(torch.uint8)


def _bytes_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 ``[..., k * itemsize]`` as ``dtype [..., k]``.

    Copies first (``contiguous``) because the byte slice may start at an offset
    that is not a multiple of the itemsize (tiny latent sizes).
    """
    return buf.contiguous().view(dtype)


# --------------------------------------------------------------------------
# MLA latent cache, fp8 (DeepSeek-V3.2 / GLM-5 FlashMLA format)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaFp8Format:
    """Per-token byte geometry of the fp8 MLA cache.

    One token is ``bytes_per_token`` uint8::

        [0, r)                      r float8_e4m3fn: latent[i] / scale[tile(i)]
        [r, r + 4 * n_tiles)        n_tiles float32 scales, scale[t] = amax(tile t) / 448
        [r + 4 * n_tiles, end)      rope_dim bfloat16 rope values

    Tiles are ``FP8_TILE`` (128) consecutive latent elements; the last tile is
    narrower when ``kv_lora_rank`` is not a multiple of 128 (tiny test models).
    For kv_lora_rank 512 / rope 64 this is FlashMLA's 656-byte token.

    :func:`quantize_mla_fp8` rounds ``amax / 448`` once (IEEE division), which makes
    re-quantizing a dequantized token byte-identical. Caches written elsewhere
    may round the scale differently (the H100 golden cache is one ulp off in
    ~14% of tiles, e.g. ``amax * (1/448)``); readers only rely on the bytes.
    """

    kv_lora_rank: int
    rope_dim: int

    def __post_init__(self) -> None:
        _check_dim("kv_lora_rank", self.kv_lora_rank)
        # rope_dim 0 is a well-defined (if unusual) format: latent + scales only.
        _check_dim("rope_dim", self.rope_dim, allow_zero=True)

    @property
    def n_tiles(self) -> int:
        return -(-self.kv_lora_rank // FP8_TILE)

    @property
    def tile_bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` latent indices of each tile; the last one may be narrower."""
        r = self.kv_lora_rank
        return tuple((s, min(s + FP8_TILE, r)) for s in range(0, r, FP8_TILE))

    @property
    def scale_offset(self) -> int:
        return self.kv_lora_rank

    @property
    def rope_offset(self) -> int:
        return self.kv_lora_rank + _SCALE_BYTES * self.n_tiles

    @property
    def bytes_per_token(self) -> int:
        return self.rope_offset + _ROPE_BYTES * self.rope_dim

    @property
    def bytes_per_page(self) -> int:
        return PAGE_SIZE * self.bytes_per_token


def _tile_amax(latent: torch.Tensor, fmt: MlaFp8Format) -> torch.Tensor:
    """fp32 ``[n, n_tiles]`` max |x| of each tile (the last may be narrower)."""
    n, r = latent.shape
    pad = fmt.n_tiles * FP8_TILE - r
    # Zero padding never changes a max of absolute values.
    padded = torch.nn.functional.pad(latent.abs(), (0, pad))
    return padded.view(n, fmt.n_tiles, FP8_TILE).amax(dim=-1)


def _per_element(tile_values: torch.Tensor, fmt: MlaFp8Format) -> torch.Tensor:
    """Expand ``[n, n_tiles]`` to ``[n, kv_lora_rank]`` (each tile's value on its elements)."""
    # Every tile is FP8_TILE wide but the last, which is cut: expand, then cut. (Per-tile widths as a
    # tensor made this a host-to-device copy and a length read-back, two stalls per call on a GPU.)
    n = tile_values.shape[0]
    full = tile_values[:, :, None].expand(n, fmt.n_tiles, FP8_TILE).reshape(n, fmt.n_tiles * FP8_TILE)
    return full[:, : fmt.kv_lora_rank]


def quantize_mla_fp8(
    latent: torch.Tensor, rope: torch.Tensor, fmt: MlaFp8Format | None = None
) -> torch.Tensor:
    """Quantize tokens to the fp8 MLA cache format.

    Args:
        latent: ``[n, r]`` float32 / bfloat16 / float16, the normed KV latent.
        rope: ``[n, d]`` float, the rotated rope key (stored as bfloat16).
        fmt: geometry; derived from the shapes when omitted, checked when given.

    Returns:
        uint8 ``[n, fmt.bytes_per_token]``. Per tile: ``scale = amax / 448``
        (fp32), values ``latent / scale`` cast to float8_e4m3fn; an all-zero tile
        stores scale 0 and zero values.
    """
    if latent.dim() != 2 or rope.dim() != 2 or latent.shape[0] != rope.shape[0]:
        raise ValueError(
            f"expected latent [n, r] and rope [n, d], got {tuple(latent.shape)} and {tuple(rope.shape)}"
        )
    if fmt is None:
        fmt = MlaFp8Format(latent.shape[1], rope.shape[1])
    elif (latent.shape[1], rope.shape[1]) != (fmt.kv_lora_rank, fmt.rope_dim):
        raise ValueError(
            f"latent/rope widths {latent.shape[1]}/{rope.shape[1]} do not match {fmt}"
        )
    n = latent.shape[0]
    x = latent.float()
    scale, divisor = _scale_from_amax(_tile_amax(x, fmt))
    values = _to_fp8(x / _per_element(divisor, fmt))
    out = torch.empty(n, fmt.bytes_per_token, dtype=torch.uint8, device=latent.device)
    out[:, : fmt.scale_offset] = values.view(torch.uint8)
    out[:, fmt.scale_offset : fmt.rope_offset] = _float_bytes(scale)
    out[:, fmt.rope_offset :] = _float_bytes(rope.to(torch.bfloat16))
    return out


def dequantize_mla_fp8(
    buf: torch.Tensor, fmt: MlaFp8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`quantize_mla_fp8`.

    Args:
        buf: uint8 ``[n, fmt.bytes_per_token]`` (any leading shape is flattened
            to ``n``; a FlashMLA view ``[pages, 64, 1, B]`` works too).

    Returns:
        ``(latent, rope)``: float32 ``[n, r]`` = fp8 value * fp32 tile scale
        (computed in fp32), and float32 ``[n, d]`` = the stored bfloat16 rope,
        exactly.
    """
    if buf.dtype != torch.uint8 or buf.shape[-1] != fmt.bytes_per_token:
        raise ValueError(
            f"expected uint8 [..., {fmt.bytes_per_token}], got {buf.dtype} {tuple(buf.shape)}"
        )
    flat = buf.reshape(-1, fmt.bytes_per_token)
    values = _bytes_as(flat[:, : fmt.scale_offset], FP8_DTYPE).float()
    scale = _bytes_as(flat[:, fmt.scale_offset : fmt.rope_offset], torch.float32)
    latent = values * _per_element(scale, fmt)
    rope = _bytes_as(flat[:, fmt.rope_offset :], torch.bfloat16).float()
    return latent, rope


# --------------------------------------------------------------------------
# Indexer key cache, fp8 (DeepGEMM paged MQA logits format)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexerFp8Format:
    """Byte geometry of the fp8 indexer-key cache.

    A token is ``head_dim`` float8_e4m3fn (key / scale) plus one float32 scale
    (``amax / 448`` over the whole key): ``head_dim + 4`` bytes (132 for 128).
    Tokens are *not* interleaved: a page of 64 tokens is ``64 * head_dim`` fp8
    bytes (token-major) followed by 64 float32 scales, ``64 * (head_dim + 4)``
    bytes (8448 for 128). DeepGEMM is nevertheless handed the page as
    ``(num_pages, 64, 1, head_dim + 4)``: that view only fixes the page stride.
    """

    head_dim: int

    def __post_init__(self) -> None:
        _check_dim("head_dim", self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.head_dim + _SCALE_BYTES

    @property
    def bytes_per_page(self) -> int:
        return PAGE_SIZE * self.bytes_per_token

    @property
    def scale_offset(self) -> int:
        """Byte offset of the 64 scales within a page."""
        return PAGE_SIZE * self.head_dim


def quantize_indexer_fp8(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 quantization of indexer keys.

    Args:
        k: ``[n, D]`` float.

    Returns:
        ``(k_fp8, scale)``: float8_e4m3fn ``[n, D]`` = k / scale and float32
        ``[n]`` = amax / 448 (0 for an all-zero key, which stores zeros).
    """
    if k.dim() != 2:
        raise ValueError(f"expected k [n, D], got {tuple(k.shape)}")
    x = k.float()
    scale, divisor = _scale_from_amax(x.abs().amax(dim=-1))
    return _to_fp8(x / divisor[:, None]), scale


def dequantize_indexer_fp8(k_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``k_fp8 [..., D]`` (float8_e4m3fn or its uint8 bytes) * ``scale [...]`` -> float32 ``[..., D]``."""
    if k_fp8.dtype == torch.uint8:
        k_fp8 = k_fp8.view(FP8_DTYPE)
    return k_fp8.float() * scale.float()[..., None]


def pack_indexer_page(k_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Pack whole pages.

    Args:
        k_fp8: float8_e4m3fn (or uint8) ``[..., 64, D]``.
        scale: float32 ``[..., 64]``.

    Returns:
        uint8 ``[..., 64 * (D + 4)]``: the 64 keys' bytes, then the 64 scales.
    """
    if k_fp8.shape[-2] != PAGE_SIZE or scale.shape != k_fp8.shape[:-1]:
        raise ValueError(
            f"expected k_fp8 [..., {PAGE_SIZE}, D] and scale [..., {PAGE_SIZE}], "
            f"got {tuple(k_fp8.shape)} and {tuple(scale.shape)}"
        )
    lead = k_fp8.shape[:-2]
    kb = k_fp8.contiguous().view(torch.uint8).reshape(*lead, -1)
    sb = _float_bytes(scale.to(torch.float32)).reshape(*lead, -1)
    return torch.cat([kb, sb], dim=-1)


def unpack_indexer_page(
    pages: torch.Tensor, fmt: IndexerFp8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_indexer_page`.

    Args:
        pages: uint8 ``[..., 64 * (D + 4)]`` or DeepGEMM's ``[P, 64, 1, D + 4]`` view.

    Returns:
        ``(k_fp8 float8_e4m3fn [P, 64, D], scale float32 [P, 64])`` with ``P``
        the flattened leading pages.
    """
    if pages.dtype != torch.uint8 or pages.numel() % fmt.bytes_per_page:
        raise ValueError(
            f"expected uint8 pages of {fmt.bytes_per_page} bytes, got {pages.dtype} {tuple(pages.shape)}"
        )
    flat = pages.reshape(-1, fmt.bytes_per_page)
    k_fp8 = _bytes_as(flat[:, : fmt.scale_offset], FP8_DTYPE).view(-1, PAGE_SIZE, fmt.head_dim)
    scale = _bytes_as(flat[:, fmt.scale_offset :], torch.float32)
    return k_fp8, scale
