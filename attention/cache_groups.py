"""Cache groups: caches of different geometry side by side (DeepSeek-V4).

A model whose layers keep different kinds of cache declares them as groups
instead of one global page size (``attention.cache.CacheSpec`` remains the
single-group form of DeepSeek-V3.2 / GLM-5). A group is one kind of cache
shared by a set of layers, with one page geometry:

* ``swa``: the uncompressed sliding-window keys of the last ``window`` tokens;
* ``compressed``: one entry per ``ratio`` source tokens (V4's c4 / c128 caches);
* ``indexer``: the lightning indexer's keys over a compressed cache (same ratio);
* ``state``: per-sequence compressor state, the raw projections of the last
  source tokens (the partially filled compressed block, for overlapping
  windows the block before it, and a few positions of slack) in a ring of
  ``tokens_per_page`` slots keyed by position: one page per sequence.

A group's positions (tokens, entries or state slots) are addressed like every
paged cache: ``page * tokens_per_page + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_KINDS = ("swa", "compressed", "indexer", "state")


@dataclass(frozen=True)
class CacheGroup:
    """One cache group (see the module docstring).

    name:            unique within a model, e.g. ``"swa"``, ``"csa_kv"``
    kind:            one of ``GROUP_KINDS``
    tokens_per_page: positions one page holds
    bytes_per_token: bytes of one position, padding included
    page_bytes:      bytes of one page (>= tokens_per_page * bytes_per_token: formats may pad)
    layers:          the attention layers that own one such cache each, ascending
    ratio:           source tokens per stored position (1 for ``swa``)
    window:          ``swa`` only: tokens a sequence keeps (older ones are never read)
    """

    name: str
    kind: str
    tokens_per_page: int
    bytes_per_token: int
    page_bytes: int
    layers: tuple[int, ...]
    ratio: int = 1
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"CacheGroup {self.name!r}: kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        for field in ("tokens_per_page", "bytes_per_token", "page_bytes", "ratio"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"CacheGroup {self.name!r}: {field} must be a positive int, got {v!r}")
        if self.page_bytes < self.tokens_per_page * self.bytes_per_token:
            raise ValueError(f"CacheGroup {self.name!r}: page_bytes {self.page_bytes} < tokens_per_page * "
                             f"bytes_per_token = {self.tokens_per_page * self.bytes_per_token}")
        if list(self.layers) != sorted(set(self.layers)) or not self.layers:
            raise ValueError(f"CacheGroup {self.name!r}: layers must be distinct, ascending and non-empty, "
                             f"got {self.layers!r}")
        if (self.kind == "swa") != (self.window is not None):
            raise ValueError(f"CacheGroup {self.name!r}: window is set for (and only for) kind 'swa'")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"CacheGroup {self.name!r}: window must be >= 1, got {self.window!r}")

    def positions_for_tokens(self, num_tokens: int) -> int:
        """Positions one sequence of ``num_tokens`` tokens needs in this group's cache of one layer:
        ``min(n, window)`` (swa), ``n // ratio`` complete entries (compressed, indexer),
        ``tokens_per_page`` (state: always one page)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self.kind == "swa":
            return min(num_tokens, self.window)
        if self.kind == "state":
            return self.tokens_per_page
        return num_tokens // self.ratio

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages of one layer's cache that a sequence of ``num_tokens`` tokens touches (swa: the
        pages of positions ``[n - window, n)``, two where the window straddles a page boundary)."""
        if self.kind == "swa" and num_tokens > 0:
            first = max(0, num_tokens - self.window)
            return (num_tokens - 1) // self.tokens_per_page - first // self.tokens_per_page + 1
        return -(-self.positions_for_tokens(num_tokens) // self.tokens_per_page)
