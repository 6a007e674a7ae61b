"""DeepSeek-V4 cache byte format (DESIGN.md, "DeepSeek-V4"): one quantize, one dequantize.

A token (a sliding-window key or a compressed entry; key = value) of width
``nope + rope`` is stored as::

    part  (nope + 2 * rope bytes): nope float8_e4m3fn (value / its tile's scale), then rope bfloat16
    scale (scale_bytes):           one UE8M0 byte per tile of 64 nope values (2^(byte - 127)), zero-padded

For DeepSeek-V4 (448 nope + 64 rope) that is 448 + 128 = 576 part bytes and 7 scales
padded to 8: 584 bytes a token. A page holds ``PAGE_TOKENS`` (256) tokens: first
all their parts, then all their scale rows, then zeros up to a multiple of the part
size (149,760 bytes for DeepSeek-V4). FlashMLA's V4 kernels view a pool of pages as
``as_strided((pages, 256, 1, 584), (page_bytes, 584, 584, 1))`` (``kernel_view``):
they take the format from the last dimension and the page stride from ``stride(0)``.

Scales are powers of two: ``2 ** ceil(log2(amax / 448))`` with ``amax`` clamped
below at ``1e-4`` (DeepSeek's UE8M0 activation quantizer), so an all-zero tile
stores zeros and a finite scale, never NaN. Slots are ``page * 256 + offset``,
``-1`` = none (skipped on write, zeros on read).

The paged-token helpers (`token_bytes_at`, `write_tokens`, `read_tokens`, `round_trip_v4`) take any
token format with this part / scale page geometry and ``quantize`` / ``dequantize`` methods: this one,
or the fp8 indexer keys' (``attention.v4_index_format.V4IndexFormat``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_TOKENS = 256
"""Tokens per V4 cache page (sliding-window and compressed caches alike)."""

SCALE_TILE = 64
"""nope values sharing one UE8M0 scale."""

FP8_MAX = 448.0
_AMAX_FLOOR = 1e-4
_UE8M0_BIAS = 127


def check_positive(fmt, *names: str) -> None:
    """A format's integer fields must be positive ints (not bools)."""
    for name in names:
        v = getattr(fmt, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


class PartsThenScales:
    """A token format whose page holds ``page_tokens`` parts of ``part_bytes``, then as many scale rows of
    ``scale_bytes``: the geometry the page helpers below address (`token_bytes_at`)."""

    page_tokens: int
    part_bytes: int
    scale_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.part_bytes + self.scale_bytes

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scale rows in a page."""
        return self.page_tokens * self.part_bytes


@dataclass(frozen=True)
class V4CacheFormat(PartsThenScales):
    """Byte geometry of one V4 cache token and page (defaults: DeepSeek-V4, 584-byte tokens)."""

    nope_dim: int = 448
    rope_dim: int = 64
    page_tokens: int = PAGE_TOKENS

    def __post_init__(self) -> None:
        check_positive(self, "nope_dim", "rope_dim", "page_tokens")

    @classmethod
    def for_head(cls, head_dim: int, rope_dim: int, page_tokens: int = PAGE_TOKENS) -> "V4CacheFormat":
        """The format of a model's ``head_dim``-wide key whose last ``rope_dim`` channels are rotated."""
        if rope_dim >= head_dim:
            raise ValueError(f"rope_dim ({rope_dim}) must be < head_dim ({head_dim})")
        return cls(head_dim - rope_dim, rope_dim, page_tokens)

    @property
    def head_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def n_scales(self) -> int:
        """UE8M0 scales per token: one per 64 nope values (the last tile may be narrower)."""
        return -(-self.nope_dim // SCALE_TILE)

    @property
    def part_bytes(self) -> int:
        """fp8 nope + bf16 rope bytes of a token (576 for DeepSeek-V4)."""
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        """Scale bytes of a token: ``n_scales`` padded to a multiple of 8 (8 for DeepSeek-V4)."""
        return -(-self.n_scales // 8) * 8

    @property
    def page_bytes(self) -> int:
        """Parts, then scales, padded to a multiple of ``part_bytes`` (149,760 for DeepSeek-V4)."""
        used = self.page_tokens * self.bytes_per_token
        return -(-used // self.part_bytes) * self.part_bytes

    def describe(self) -> str:
        return f"v4fp8[{self.nope_dim}+{self.rope_dim}]x{self.bytes_per_token}"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize_v4` in this format: what the paged-token helpers below call on any token format
        (this one, or ``attention.v4_index_format.V4IndexFormat``)."""
        return quantize_v4(x, self)

    def dequantize(self, parts: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_v4(parts, scales, self)


def _check_tokens(x: torch.Tensor, fmt: V4CacheFormat) -> None:
    if x.dim() != 2 or x.shape[1] != fmt.head_dim:
        raise ValueError(f"tokens must be [n, {fmt.head_dim}] (nope {fmt.nope_dim} + rope {fmt.rope_dim}), "
                         f"got {tuple(x.shape)}")


def quantize_v4(x: torch.Tensor, fmt: V4CacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x float ``[n, nope + rope]`` -> (parts uint8 ``[n, part_bytes]``, scales uint8 ``[n, scale_bytes]``)."""
    _check_tokens(x, fmt)
    n = x.shape[0]
    nope = x[:, :fmt.nope_dim].float()
    padded = torch.zeros(n, fmt.n_scales * SCALE_TILE, dtype=torch.float32, device=x.device)
    padded[:, :fmt.nope_dim] = nope
    tiles = padded.view(n, fmt.n_scales, SCALE_TILE)
    amax = tiles.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR)
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-_UE8M0_BIAS, _UE8M0_BIAS)
    q = (tiles / torch.exp2(exp)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    parts = torch.empty(n, fmt.part_bytes, dtype=torch.uint8, device=x.device)
    parts[:, :fmt.nope_dim] = q.view(n, -1)[:, :fmt.nope_dim].view(torch.uint8)
    parts[:, fmt.nope_dim:] = x[:, fmt.nope_dim:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(n, fmt.scale_bytes, dtype=torch.uint8, device=x.device)
    scales[:, :fmt.n_scales] = (exp + _UE8M0_BIAS).to(torch.uint8)
    return parts, scales


def dequantize_v4(parts: torch.Tensor, scales: torch.Tensor, fmt: V4CacheFormat) -> torch.Tensor:
    """(parts uint8 ``[n, part_bytes]``, scales uint8 ``[n, scale_bytes]``) -> f32 ``[n, nope + rope]``."""
    if parts.shape[-1] != fmt.part_bytes or scales.shape[-1] != fmt.scale_bytes:
        raise ValueError(f"parts [n, {fmt.part_bytes}] and scales [n, {fmt.scale_bytes}] expected, "
                         f"got {tuple(parts.shape)} and {tuple(scales.shape)}")
    n = parts.shape[0]
    q = parts[:, :fmt.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    exp = scales[:, :fmt.n_scales].float() - _UE8M0_BIAS
    scale = torch.exp2(exp).repeat_interleave(SCALE_TILE, dim=1)[:, :fmt.nope_dim]
    rope = parts[:, fmt.nope_dim:].contiguous().view(torch.bfloat16).float()
    return torch.cat([q * scale, rope.view(n, fmt.rope_dim)], dim=1)


def new_pages(num_pages: int, fmt: V4CacheFormat, device=None) -> torch.Tensor:
    """A zero-filled pool: uint8 ``[num_pages, page_bytes]``."""
    return torch.zeros(num_pages, fmt.page_bytes, dtype=torch.uint8, device=device)


def _page_offsets(slots: torch.Tensor, pages: torch.Tensor, fmt: V4CacheFormat):
    slots = slots.long()
    if slots.numel() and int(slots.max()) >= pages.shape[0] * fmt.page_tokens:
        raise IndexError(f"slot {int(slots.max())} is outside a pool of {pages.shape[0]} pages of {fmt.page_tokens}")
    if slots.numel() and int(slots.min()) < -1:
        raise IndexError(f"slots must be >= -1, got {int(slots.min())}")
    return slots // fmt.page_tokens, slots % fmt.page_tokens


def token_bytes_at(base: torch.Tensor, off: torch.Tensor, fmt: V4CacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Where tokens live in a flat byte buffer: the one token-offset rule of the format.

    base int64 ``[n]``: byte offset of each token's page in the buffer; off int64 ``[n]``: the token's
    offset in its page (``< page_tokens``) -> byte indices int64 ``[n, part_bytes]`` of its part
    (page start + ``off * part_bytes``) and ``[n, scale_bytes]`` of its scale row (page start +
    ``scale_offset + off * scale_bytes``)."""
    dev = base.device
    part_at = (base + off * fmt.part_bytes)[:, None] + torch.arange(fmt.part_bytes, device=dev)
    scale_at = (base + fmt.scale_offset + off * fmt.scale_bytes)[:, None] + torch.arange(fmt.scale_bytes, device=dev)
    return part_at, scale_at


def write_tokens(flat: torch.Tensor, base: torch.Tensor, off: torch.Tensor, x: torch.Tensor,
                 fmt: V4CacheFormat) -> None:
    """Quantize tokens x ``[n, nope + rope]`` into the flat uint8 buffer ``flat`` (1-D, written in place)
    at pages starting at byte ``base`` int64 ``[n]``, offsets ``off`` int64 ``[n]`` (`token_bytes_at`)."""
    parts, scales = fmt.quantize(x)
    part_at, scale_at = token_bytes_at(base, off, fmt)
    flat[part_at.reshape(-1)] = parts.reshape(-1)
    flat[scale_at.reshape(-1)] = scales.reshape(-1)


def read_tokens(flat: torch.Tensor, base: torch.Tensor, off: torch.Tensor, fmt: V4CacheFormat) -> torch.Tensor:
    """Dequantized tokens f32 ``[n, nope + rope]`` stored in ``flat`` as `write_tokens` put them."""
    part_at, scale_at = token_bytes_at(base, off, fmt)
    return fmt.dequantize(flat[part_at], flat[scale_at])


def round_trip_v4(x: torch.Tensor, fmt: V4CacheFormat) -> torch.Tensor:
    """x ``[n, nope + rope]`` as the cache gives it back (quantize, then dequantize), in x's dtype.

    A model computing with fp8 caches uses these values from the moment a key exists, so a key
    read back from pages equals the one used in the forward that made it: re-quantizing a
    round-tripped token gives the same values (power-of-two scales; tests/attention/test_v4_format.py),
    and fp8 x 2^k and bf16 rope values are exact in bf16 / fp32 ``x``."""
    return fmt.dequantize(*fmt.quantize(x)).to(x.dtype)


def write_v4(pages: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: V4CacheFormat) -> None:
    """Quantize tokens x ``[n, nope + rope]`` into ``pages`` uint8 ``[P, page_bytes]`` at
    ``slots`` int ``[n]`` (``-1`` skipped; another slot outside the pool: IndexError)."""
    keep = slots >= 0
    page, off = _page_offsets(slots[keep], pages, fmt)
    write_tokens(pages.view(-1), page * fmt.page_bytes, off, x[keep], fmt)


def read_v4(pages: torch.Tensor, slots: torch.Tensor, fmt: V4CacheFormat) -> torch.Tensor:
    """Dequantized tokens f32 ``[n, nope + rope]`` at ``slots`` int ``[n]`` (``-1`` -> zeros)."""
    keep = slots >= 0
    page, off = _page_offsets(torch.where(keep, slots, 0), pages, fmt)
    got = read_tokens(pages.view(-1), page * fmt.page_bytes, off, fmt)
    # where, not a multiply: a never-written slot's bytes may decode to NaN.
    return torch.where(keep[:, None], got, 0.0)


def kernel_view(pages: torch.Tensor, fmt: V4CacheFormat) -> torch.Tensor:
    """FlashMLA's view of a pool uint8 ``[P, page_bytes]``: ``(P, page_tokens, 1, bytes_per_token)``
    with the pool's page stride (the kernel locates parts and scales itself). A page's bytes must be
    contiguous; pages may lie any multiple of ``part_bytes`` (576) >= ``page_bytes`` apart (one layer's V4
    pages inside a grouped cache's pages, ``attention.group_cache.GroupedPagedCache.kernel_view``): the
    kernel reads a page in rows of the token part and asserts ``stride(0) % 576 == 0``."""
    if (pages.dim() != 2 or pages.dtype != torch.uint8 or pages.shape[1] != fmt.page_bytes or pages.stride(1) != 1
            or (pages.shape[0] > 1 and (pages.stride(0) < fmt.page_bytes or pages.stride(0) % fmt.part_bytes))):
        raise ValueError(f"pages must be uint8 [P, {fmt.page_bytes}], each page contiguous and pages a multiple of "
                         f"{fmt.part_bytes} bytes apart, got {pages.dtype} {tuple(pages.shape)} strides {pages.stride()}")
    b = fmt.bytes_per_token
    stride = pages.stride(0) if pages.shape[0] > 1 else fmt.page_bytes
    return pages.as_strided((pages.shape[0], fmt.page_tokens, 1, b), (stride, b, b, 1))
