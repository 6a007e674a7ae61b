"""Paged storage of a model whose caches come in groups (``attention.cache_groups``): DeepSeek-V4.

Each group has its own page geometry and its own page ids (the workers give every
group a page pool of its own): group ``g``'s page ``p`` holds, for every layer of
the group, ``tokens_per_page`` positions of ``width`` elements in ``dtype``,
laid out ``[layers, positions, width]`` (cross-layer: one page run of one group is
one block for all its layers, as ``attention.cache``'s ``cross_layer`` layout).

All groups live in ONE uint8 buffer cut into *units* of ``UNIT_BYTES``: group
``g``'s page ``p`` is the units ``first[g] + p * k[g] .. + k[g]`` (``k[g]`` =
its page bytes rounded up to whole units). The buffer is registered as one
transfer region whose "page" is a unit, so a request's pages of every group
move prefill -> decode through the existing region table, plan, push and
receive code as one list of unit ids (`units`): the transfer layer pairs
position ``i`` of the two lists, as it pairs V3.2's pages, and merges each
group page's ``k[g]`` consecutive units (and runs of consecutive pages) into
one descriptor. `pages_of_units` maps such a list back to group pages.

This module only stores values; what a position of a group means (a token's
sliding-window key, a compressed entry, a compressor state slot) is the
model's business (``models.v4.paged_state``). A group is stored either

* unquantized (`GroupLayout.fmt` None): ``width`` values of ``dtype`` per position,
  the page ``[layers, positions, width]``; or
* in the V4 fp8 format (`GroupLayout.fmt` a ``V4CacheFormat``: ``kv_cache_dtype``
  ``"fp8"``): the page is one 584-byte-token V4 page (``attention.v4_format``: 256
  tokens' 576-byte parts, then their scale rows, padded) per layer,
  ``[layers, fmt.page_bytes]`` uint8; `write` quantizes and `read` dequantizes
  through ``v4_format``'s own token-offset rule (`v4_format.token_bytes_at`).
  Layer ``l``'s V4 pages of the group start ``l * fmt.page_bytes`` into each group
  page, one group page (``units_per_page * UNIT_BYTES``) apart: a kernel view is
  ``v4_format.kernel_view``'s shape with that page stride; or
* as fp8 indexer keys (`GroupLayout.fmt` a ``V4IndexFormat``, ``attention.v4_index_format``:
  the ``csa_index`` group under ``"fp8"``): per layer one page of 256 keys' fp8 bytes, then
  their fp32 scales, through the same token-offset rule.

In the cuda backend's cache (``page_kernels``) on a CUDA buffer both fp8 formats are
written and read by the Triton kernels of ``attention.cuda.v4_cache_ops`` (one launch a
call, the same bytes and values as the torch spec); `v4_page_ops` is that rule.

A group page's bytes are the group's declared ``page_bytes`` (``CacheGroup``) per
layer, nothing else: `GroupLayout` refuses a group whose declared geometry is not
what it stores.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .cache import ALL_LAYERS, CacheRegion
from .cache_groups import CacheGroup
from .v4_format import V4CacheFormat, kernel_view, read_tokens, write_tokens
from .v4_index_format import V4IndexFormat

UNIT_BYTES = 4096
"""Bytes of one transfer unit. Small against a group page at real scale (the padding is under
one unit per page), large enough that the unit count stays far below NIXL's int32 index bound."""

GROUP_REGION_KIND = "groups"
"""`CacheRegion.kind` of the one region of a grouped cache (layer ``ALL_LAYERS``)."""


def page_offset(table: torch.Tensor, positions: torch.Tensor, tokens_per_page: int, rowwise: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """THE position rule of a group: position ``t`` of a sequence whose pages are ``table`` is page
    ``table[t // tokens_per_page]``, offset ``t % tokens_per_page`` -> (page, offset) int64 like ``positions``.

    table int64 ``[max_pages]``; ``rowwise``: ``[n, max_pages]`` with positions ``[n, k]``, row ``i``
    through ``table[i]``. Positions must lie inside the table (callers check or mask)."""
    idx = positions // tokens_per_page
    page = table.gather(1, idx) if rowwise else table[idx]
    return page, positions % tokens_per_page


def slot_of(page: torch.Tensor, offset: torch.Tensor, tokens_per_page: int) -> torch.Tensor:
    """A (page, offset) of `page_offset` as one kernel slot, ``page * tokens_per_page + offset`` (the index
    FlashMLA's paged kernels and ``attention.cuda.v4_cache_ops`` take)."""
    return page * tokens_per_page + offset


def padded_tables(page_lists: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Sequences' page lists of one group -> int64 ``[R, max(len)]``, ``-1`` past each list's end
    (`GroupedPagedCache.kernel_slots`'s tables)."""
    width = max((len(p) for p in page_lists), default=0)
    out = torch.full((len(page_lists), max(width, 1)), -1, dtype=torch.int64)
    for r, pages in enumerate(page_lists):
        out[r, :len(pages)] = torch.as_tensor(list(pages), dtype=torch.int64)
    return out.to(device)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def v4_page_ops(t: torch.Tensor):
    """THE rule of who writes and reads fp8-format pages (`GroupedPagedCache`'s V4 tokens and indexer keys):
    ``attention.cuda.v4_cache_ops`` (one Triton launch a call, the same bytes) for a buffer on CUDA where
    triton imports, else None: the torch spec (``v4_format.write_tokens`` / ``read_tokens``)."""
    if not t.is_cuda or not _triton_importable():
        return None
    from .cuda import v4_cache_ops

    return v4_cache_ops


@dataclass(frozen=True)
class V4Source:
    """One paged source of a V4 layer's decode attention (``attention.cuda.v4_decode``).

    group:     the cache group (``"swa"``, ``"csa_kv"``, ``"hca_kv"``);
    tables:    int64 ``[R, max_pages]``, each sequence's pages of the group (``-1`` past the last;
               ``attention.group_cache.padded_tables``);
    positions: int64 ``[n, k]``, the group positions each query reads (``-1`` = none), any order.
    """

    group: str
    tables: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class GroupLayout:
    """How one cache group is stored (module docstring).

    group: the group, whose ``bytes_per_token`` / ``page_bytes`` must be what this layout stores;
    dtype: the stored element type (``torch.uint8`` with ``fmt``);
    width: values a position holds (read returns ``[n, width]``);
    fmt:   None (unquantized: ``width`` x ``dtype`` a position), the V4 fp8 token format or the fp8
           indexer-key format (``fmt.head_dim == width``, ``fmt.page_tokens == group.tokens_per_page``).
    """

    group: CacheGroup
    dtype: torch.dtype
    width: int
    fmt: V4CacheFormat | V4IndexFormat | None = None

    def __post_init__(self) -> None:
        g = self.group
        if self.fmt is None:
            want = (self.width * self.dtype.itemsize, g.tokens_per_page * self.width * self.dtype.itemsize)
        else:
            if self.dtype != torch.uint8 or self.fmt.head_dim != self.width or self.fmt.page_tokens != g.tokens_per_page:
                raise ValueError(f"group {g.name!r}: an fp8-format layout stores uint8 pages of {g.tokens_per_page} "
                                 f"tokens of width {self.width}, got dtype {self.dtype}, format {self.fmt}")
            want = (self.fmt.bytes_per_token, self.fmt.page_bytes)
        if (g.bytes_per_token, g.page_bytes) != want:
            raise ValueError(f"group {g.name!r} declares {g.bytes_per_token} bytes a position and {g.page_bytes} a "
                             f"page (per layer); this layout stores {want[0]} and {want[1]}")

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer of the group: the declared page bytes per layer."""
        return len(self.group.layers) * self.group.page_bytes

    @property
    def units_per_page(self) -> int:
        units = -(-self.page_bytes // UNIT_BYTES)
        if isinstance(self.fmt, V4CacheFormat):
            # FlashMLA's V4 decode reads a page in rows of the token part (576 bytes) and asserts
            # `k_cache.stride(0) % 576 == 0` (the installed _C_legacy's message); the group page is
            # that stride (`kernel_view`), so it is a whole number of units and of token parts.
            step = self.fmt.part_bytes // math.gcd(self.fmt.part_bytes, UNIT_BYTES)
            units = -(-units // step) * step
        return units

    def describe(self) -> str:
        """The stored format, e.g. ``bfloat16x32`` or ``v4fp8[448+64]x584`` (compatibility checks)."""
        if self.fmt is not None:
            return self.fmt.describe()
        return f"{str(self.dtype).removeprefix('torch.')}x{self.width}"


class GroupedPagedCache:
    """The pages of every group (see the module docstring).

    layouts:   one per group, in a fixed order (the order of `units` lists);
    num_pages: pages of each group (group name -> count);
    device:    where the buffer lives.
    """

    def __init__(self, layouts: Sequence[GroupLayout], num_pages: Mapping[str, int], device: str | torch.device,
                 page_kernels: bool = False):
        names = [lay.name for lay in layouts]
        if len(set(names)) != len(names) or set(names) != set(num_pages):
            raise ValueError(f"num_pages must name each group once: groups {names}, num_pages {sorted(num_pages)}")
        for n, p in num_pages.items():
            if isinstance(p, bool) or not isinstance(p, int) or p <= 0:
                raise ValueError(f"num_pages[{n!r}] must be a positive int, got {p!r}")
        self.layouts = {lay.name: lay for lay in layouts}
        self.num_pages = dict(num_pages)
        # The cuda backend's cache writes and reads its fp8-format pages with the Triton kernels
        # (`v4_page_ops`); the reference backend keeps the torch spec on any device (it is the oracle).
        self.page_kernels = page_kernels
        self.first_unit: dict[str, int] = {}
        total = 0
        for lay in layouts:
            self.first_unit[lay.name] = total
            total += num_pages[lay.name] * lay.units_per_page
        self.num_units = total
        self.device = torch.device(device)
        self.buffer = torch.zeros(total, UNIT_BYTES, dtype=torch.uint8, device=self.device)
        self._views = {lay.name: self._make_view(lay) for lay in layouts}
        # Layer id -> its index inside each group's page (a group holds a subset of the layers).
        self.layer_slot = {lay.name: {layer: i for i, layer in enumerate(lay.group.layers)} for lay in layouts}

    def _make_view(self, lay: GroupLayout) -> torch.Tensor:
        first, k, P = self.first_unit[lay.name], lay.units_per_page, self.num_pages[lay.name]
        pages = self.buffer[first:first + P * k].view(P, k * UNIT_BYTES)[:, :lay.page_bytes]
        g = lay.group
        if lay.fmt is not None:
            return pages.view(P, len(g.layers), lay.fmt.page_bytes)
        return pages.view(lay.dtype).view(P, len(g.layers), g.tokens_per_page, lay.width)

    @property
    def groups(self) -> list[CacheGroup]:
        return [lay.group for lay in self.layouts.values()]

    def view(self, name: str) -> torch.Tensor:
        """Group ``name``'s pages (a view): ``[num_pages, layers, tokens_per_page, width]`` of its dtype, or
        with a V4 format ``[num_pages, layers, fmt.page_bytes]`` uint8 (one V4 page per layer)."""
        return self._views[name]

    def read(self, name: str, layer: int, pages: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """Values of ``layer`` at a sequence's ``positions`` (int64 ``[n]``), the sequence's pages of
        group ``name`` being ``pages`` (position ``t`` is page ``pages[t // T]``, offset ``t % T``)
        -> ``[n, width]`` (V4 format: dequantized, float32)."""
        page, off = self._where(name, pages, positions)
        lay = self.layouts[name]
        if lay.fmt is not None:
            return self._read_fmt(name, layer, page, off)
        return self._views[name][page, self.layer_slot[name][layer], off]

    def write(self, name: str, layer: int, pages: Sequence[int], positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` ``[n, width]`` (cast to the group's dtype, or quantized to its V4 format) at
        ``positions`` as `read` addresses them."""
        page, off = self._where(name, pages, positions)
        lay = self.layouts[name]
        if lay.fmt is not None:
            self._write_fmt(name, layer, page, off, values)
            return
        self._views[name][page, self.layer_slot[name][layer], off] = values.to(lay.dtype)

    def write_rows(self, name: str, layer: int, tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                   values: torch.Tensor) -> None:
        """`write` for several sequences in one call: ``values`` ``[n, width]`` at ``positions`` int64 ``[n]``
        of sequence ``rows[i]``, whose pages are row ``rows[i]`` of ``tables`` (`padded_tables`). Unlike
        `write` nothing is read back: the caller guarantees each position lies inside its sequence's pages."""
        T = self.layouts[name].group.tokens_per_page
        page, off = page_offset(tables[rows.long()], positions[:, None], T, rowwise=True)
        page, off = page[:, 0], off[:, 0]
        lay = self.layouts[name]
        if lay.fmt is not None:
            self._write_fmt(name, layer, page, off, values)
            return
        self._views[name][page, self.layer_slot[name][layer], off] = values.to(lay.dtype)

    def _write_fmt(self, name: str, layer: int, page: torch.Tensor, off: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``values`` ``[n, width]`` into ``layer``'s fp8-format pages of group ``name`` at (page, off)
        int64 ``[n]``: the Triton kernels where `v4_page_ops` says so, else the torch spec."""
        lay = self.layouts[name]
        ops = v4_page_ops(self.buffer) if self.page_kernels else None
        if ops is not None:
            slots = slot_of(page, off, lay.group.tokens_per_page)
            ops.write_pages(self._layer_pages(name, layer), slots, values, lay.fmt)
        else:
            write_tokens(self.buffer.view(-1), self._page_base(name, layer, page), off, values, lay.fmt)

    def _read_fmt(self, name: str, layer: int, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """`_write_fmt`'s values read back: float32 ``[n, width]``."""
        lay = self.layouts[name]
        ops = v4_page_ops(self.buffer) if self.page_kernels else None
        if ops is not None:
            return ops.read_pages(self._layer_pages(name, layer), slot_of(page, off, lay.group.tokens_per_page),
                                  lay.fmt)
        return read_tokens(self.buffer.view(-1), self._page_base(name, layer, page), off, lay.fmt)

    def _layer_pages(self, name: str, layer: int) -> torch.Tensor:
        """``layer``'s fp8-format pages of group ``name``: uint8 ``[num_pages, fmt.page_bytes]``, one group page
        apart (the pools of ``attention.cuda.v4_cache_ops`` and, viewed per token, `kernel_view`)."""
        return self._views[name][:, self.layer_slot[name][layer]]

    def _page_base(self, name: str, layer: int, page: torch.Tensor) -> torch.Tensor:
        """Byte offset in the buffer of ``layer``'s V4 page inside each of group ``name``'s ``page`` s."""
        lay = self.layouts[name]
        group_page = (self.first_unit[name] + page * lay.units_per_page) * UNIT_BYTES
        return group_page + self.layer_slot[name][layer] * lay.fmt.page_bytes

    def _where(self, name: str, pages: Sequence[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.layouts[name].group.tokens_per_page
        positions = positions.to(self.device)
        table = torch.as_tensor(list(pages), dtype=torch.int64, device=self.device)
        if positions.numel() and int(positions.max()) >= table.numel() * T:
            raise ValueError(f"group {name!r}: position {int(positions.max())} beyond the {table.numel()} pages held")
        return page_offset(table, positions, T)

    # -- what FlashMLA's V4 decode kernel reads ------------------------------------------

    def kernel_view(self, name: str, layer: int) -> torch.Tensor:
        """``layer``'s V4 pages of group ``name`` as FlashMLA's ``kv_format="V4"`` cache: uint8
        ``(num_pages, tokens_per_page, 1, bytes_per_token)`` whose page stride is the group page's (the
        layer's V4 page sits ``layer_slot * fmt.page_bytes`` into each group page). Kernel slot
        ``page * tokens_per_page + offset`` is the group's page ``page`` (`kernel_slots`)."""
        lay = self.layouts[name]
        if not isinstance(lay.fmt, V4CacheFormat):
            raise ValueError(f"group {name!r} is not stored in the V4 fp8 token format (kv_cache_dtype 'fp8'): "
                             f"no kernel view")
        return kernel_view(self._layer_pages(name, layer), lay.fmt)

    def kernel_slots(self, name: str, tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
        """Positions of several sequences -> kernel slots of group ``name`` (`kernel_view`), by `read`'s rule.

        tables: int ``[R, max_pages]``, sequence ``r``'s pages of the group (`padded_tables`: ``-1`` past
        its last); rows: int64 ``[n]``, the sequence of each row of ``positions`` int64 ``[n, k]``
        (``-1`` = none) -> int32 ``[n, k]`` ``page * tokens_per_page + offset``, ``-1`` where the position
        is negative, past the table or on a ``-1`` page (no read-back, no range error: the caller's
        positions say what exists)."""
        T = self.layouts[name].group.tokens_per_page
        width = tables.shape[1]
        ok = (positions >= 0) & (positions < width * T)
        page, off = page_offset(tables.long()[rows.long()], torch.where(ok, positions, 0), T, rowwise=True)
        return torch.where(ok & (page >= 0), slot_of(page, off, T), -1).to(torch.int32)

    # -- transfer units --------------------------------------------------------------

    def units(self, name: str, pages: Sequence[int]) -> list[int]:
        """The unit ids of group ``name``'s ``pages`` (each page's units in order, pages in order)."""
        first, k = self.first_unit[name], self.layouts[name].units_per_page
        p = np.asarray(pages, dtype=np.int64).reshape(-1, 1)
        return (first + p * k + np.arange(k, dtype=np.int64)).reshape(-1).tolist()

    def pages_of_units(self, units: Sequence[int]) -> dict[str, list[int]]:
        """The group pages whose units ``units`` lists, each once, in first-seen order (the inverse of
        `units`, over any groups). Raises ``ValueError`` for a unit outside the cache."""
        u = np.asarray(units, dtype=np.int64).reshape(-1)
        if u.size and (int(u.min()) < 0 or int(u.max()) >= self.num_units):
            raise ValueError(f"units outside the cache's {self.num_units} units")
        out: dict[str, list[int]] = {}
        for name, lay in self.layouts.items():
            first = self.first_unit[name]
            mine = u[(u >= first) & (u < first + self.num_pages[name] * lay.units_per_page)]
            if mine.size:
                pages = (mine - first) // lay.units_per_page
                _, at = np.unique(pages, return_index=True)
                out[name] = pages[np.sort(at)].tolist()
        return out

    def regions(self) -> list[CacheRegion]:
        """The whole cache as one transfer region whose pages are the units."""
        return [CacheRegion(layer=ALL_LAYERS, kind=GROUP_REGION_KIND, tensor=self.buffer, bytes_per_page=UNIT_BYTES,
                            num_pages=self.num_units)]

    def formats(self) -> tuple[tuple[str, str], ...]:
        """``(group, format)`` per group, for the transfer compatibility check (both sides must agree)."""
        return tuple((lay.name, f"{lay.group.kind}:{lay.describe()}"
                      f"@{lay.group.tokens_per_page}/{','.join(map(str, lay.group.layers))}")
                     for lay in self.layouts.values())
