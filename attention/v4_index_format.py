"""DeepSeek-V4 indexer-key cache byte format under ``kv_cache_dtype: fp8`` (the ``csa_index`` group).

A CSA layer's indexer keys (its own compressed entries, ``index_head_dim`` wide) only rank
compressed entries for the top-k; they never enter the attention values. Stored as::

    part  (head_dim bytes): float8_e4m3fn, key / its scale
    scale (4 bytes):        float32, the key's scale: 2 ** ceil(log2(amax / 448)), amax clamped at 1e-4

A page of ``PAGE_TOKENS`` (256) keys holds all their parts, then all their scales: the layout of
DeepSeek-V3.2's fp8 indexer cache (``attention.formats.IndexerFp8Format``: per-key fp8 and one fp32
scale, what DeepGEMM's paged MQA logits reads) at V4's page size, 132 bytes a key and 33,792 a page
for ``index_head_dim`` 128. Scales are powers of two, as the V4 token format's
(``attention.v4_format``), so a round-tripped key quantizes to the same bytes again: a key read back
from pages equals the one the forward that made it used. DeepSeek's release stores these keys in fp8
too, with a scale layout of its own that this format does not claim to reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.v4_format import PAGE_TOKENS, PartsThenScales, check_positive

FP8_MAX = 448.0
_AMAX_FLOOR = 1e-4
_SCALE_BYTES = 4


@dataclass(frozen=True)
class V4IndexFormat(PartsThenScales):
    """Byte geometry of one fp8 indexer key and page (default: DeepSeek-V4's 128-wide keys)."""

    head_dim: int = 128
    page_tokens: int = PAGE_TOKENS

    def __post_init__(self) -> None:
        check_positive(self, "head_dim", "page_tokens")

    @property
    def part_bytes(self) -> int:
        return self.head_dim

    @property
    def scale_bytes(self) -> int:
        return _SCALE_BYTES

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token

    def describe(self) -> str:
        return f"idxfp8[{self.head_dim}]x{self.bytes_per_token}"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys float ``[n, head_dim]`` -> (parts uint8 ``[n, head_dim]``, scales uint8 ``[n, 4]``: float32 bytes)."""
        if x.dim() != 2 or x.shape[1] != self.head_dim:
            raise ValueError(f"indexer keys must be [n, {self.head_dim}], got {tuple(x.shape)}")
        xf = x.float()
        amax = xf.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR)
        scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
        q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8), scale.contiguous().view(torch.uint8).view(-1, _SCALE_BYTES)

    def dequantize(self, parts: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(parts uint8 ``[n, head_dim]``, scales uint8 ``[n, 4]``) -> f32 ``[n, head_dim]``."""
        if parts.shape[-1] != self.part_bytes or scales.shape[-1] != self.scale_bytes:
            raise ValueError(f"parts [n, {self.part_bytes}] and scales [n, {self.scale_bytes}] expected, "
                             f"got {tuple(parts.shape)} and {tuple(scales.shape)}")
        q = parts.contiguous().view(torch.float8_e4m3fn).float()
        return q * scales.contiguous().view(torch.float32)
