"""Region tables: where each paged cache of one worker lives in memory.

A *region* is paged cache memory: the served cache registers one ``"kv"``
region whose page holds every layer's MLA latent bytes then indexer-key bytes
(`attention.cache.PagedKVCache`, ``cross_layer``; ``layer = -1``), or one
such region per layer (``per_layer``); a model may declare more, e.g. V4's
SWA / compressed state pages. A region is a tensor
whose dim 0 is the page id and whose pages are each ``bytes_per_page``
contiguous bytes, ``num_pages`` of them back to back.
Every region of a worker shares the page ids of the worker's page pool, so
page ``p`` of a request is page ``p`` in every region.

The transfer side never looks inside a page: it only needs base address,
bytes per page and page count, which is what a `RegionEntry` keeps. Region
tables travel in the handshake so the pushing side can compute the peer's
destination addresses. A table also numbers every page of every region
(the *flat page index*, regions in table order): NIXL descriptor lists are
prepared once over it, and a WRITE names pages by their flat indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable

import numpy as np

from transfer.errors import RegionError

if TYPE_CHECKING:
    import torch

DRAM = "DRAM"
VRAM = "VRAM"

RegionKey = tuple[int, str]
"""``(layer, kind)``: kind is ``"mla"``, ``"index"`` or any state kind a model declares."""


@runtime_checkable
class CacheRegionLike(Protocol):
    """What `TransferAgent` accepts as a region (e.g. `PagedKVCache.regions()` items).

    ``tensor``: dim 0 = pages, contiguous, ``tensor.nbytes == num_pages * bytes_per_page``.
    """

    layer: int
    kind: str
    tensor: "torch.Tensor"
    bytes_per_page: int
    num_pages: int


@dataclass(frozen=True)
class CacheRegion:
    """A concrete `CacheRegionLike` (tests, benches, callers without a cache object)."""

    layer: int
    kind: str
    tensor: "torch.Tensor"
    bytes_per_page: int
    num_pages: int

    @classmethod
    def of(cls, layer: int, kind: str, tensor: "torch.Tensor") -> "CacheRegion":
        """Region over ``tensor`` ([num_pages, ...], contiguous); geometry read from its shape."""
        num_pages = int(tensor.shape[0])
        per_page = tensor.nbytes // num_pages if num_pages else 0
        return cls(layer=layer, kind=kind, tensor=tensor, bytes_per_page=per_page, num_pages=num_pages)


@dataclass(frozen=True)
class RegionEntry:
    """One registered region as the peer sees it.

    ``base_addr``: address of page 0 (bytes); page ``p`` starts at
    ``base_addr + p * bytes_per_page``. ``device_id``: CUDA ordinal for VRAM,
    0 for DRAM (NIXL's convention).
    """

    layer: int
    kind: str
    base_addr: int
    bytes_per_page: int
    num_pages: int
    mem_type: str
    device_id: int

    @property
    def key(self) -> RegionKey:
        return (self.layer, self.kind)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def page_addr(self, page: int) -> int:
        return self.base_addr + page * self.bytes_per_page

    def to_wire(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "kind": self.kind,
            "base_addr": self.base_addr,
            "bytes_per_page": self.bytes_per_page,
            "num_pages": self.num_pages,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "RegionEntry":
        return cls(
            layer=int(d["layer"]),
            kind=str(d["kind"]),
            base_addr=int(d["base_addr"]),
            bytes_per_page=int(d["bytes_per_page"]),
            num_pages=int(d["num_pages"]),
            mem_type=str(d["mem_type"]),
            device_id=int(d["device_id"]),
        )


@dataclass(frozen=True)
class RegionTable:
    """All regions of one worker (one GPU rank), in registration order.

    Every entry has the same memory type and device: one NIXL agent per rank,
    and one descriptor list per side of a transfer.
    """

    entries: tuple[RegionEntry, ...]
    _by_key: dict = field(init=False, repr=False, compare=False)
    _first_index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        keys = [e.key for e in self.entries]
        object.__setattr__(self, "_by_key", {e.key: e for e in self.entries})
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise RegionError(f"duplicate (layer, kind) regions: {dup}")
        starts = np.cumsum([0] + [e.num_pages for e in self.entries])
        object.__setattr__(self, "_first_index", {e.key: int(s) for e, s in zip(self.entries, starts)})
        if len({(e.mem_type, e.device_id) for e in self.entries}) > 1:
            raise RegionError("all regions of one agent must live on one device (one agent per rank)")
        spans = sorted((e.base_addr, e.base_addr + e.nbytes, e.key) for e in self.entries if e.nbytes)
        for (_s0, e0, k0), (s1, _e1, k1) in zip(spans, spans[1:]):
            if s1 < e0:
                # Two regions aliasing the same bytes would let one request's
                # push overwrite another cache.
                raise RegionError(f"regions {k0} and {k1} overlap in memory")

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def get(self, layer: int, kind: str) -> RegionEntry:
        return self._by_key[(layer, kind)]

    def __contains__(self, key: RegionKey) -> bool:
        return key in self._by_key

    def keys(self) -> list[RegionKey]:
        return [e.key for e in self.entries]

    # -- the flat page index (prepared NIXL descriptor lists) -----------------

    @property
    def total_pages(self) -> int:
        """Pages over every region: the length of the flat page index."""
        return sum(e.num_pages for e in self.entries)

    def first_index(self, layer: int, kind: str) -> int:
        """Flat index of page 0 of region ``(layer, kind)``.

        The flat page index numbers every page of every region, regions in
        table order: page ``p`` of region ``k`` is ``first_index(*k) + p``.
        It is the index space of the NIXL descriptor list prepared once over
        the whole table (`strided_rows` / `page_rows`), locally and for a peer.
        """
        return self._first_index[(layer, kind)]

    def strided_rows(self) -> np.ndarray:
        """One uint64 row per region, ``(base_addr, bytes_per_page, device_id, bytes_per_page, num_pages)``.

        NIXL's compressed descriptor list (``prep_xfer_dlist`` with an Nx5
        array): ``num_pages`` dense blocks of ``bytes_per_page`` bytes per row,
        i.e. exactly the flat page index.
        """
        return np.array(
            [(e.base_addr, e.bytes_per_page, e.device_id, e.bytes_per_page, e.num_pages) for e in self.entries],
            dtype=np.uint64,
        ).reshape(-1, 5)

    def page_rows(self) -> np.ndarray:
        """The flat page index spelled out: uint64 ``[total_pages, 3]`` rows ``(address, length, device_id)``."""
        out = np.empty((self.total_pages, 3), dtype=np.uint64)
        for e in self.entries:
            i = self._first_index[e.key]
            pages = np.arange(e.num_pages, dtype=np.uint64)
            out[i : i + e.num_pages, 0] = np.uint64(e.base_addr) + pages * np.uint64(e.bytes_per_page)
            out[i : i + e.num_pages, 1] = e.bytes_per_page
            out[i : i + e.num_pages, 2] = e.device_id
        return out

    @property
    def mem_type(self) -> str:
        return self.entries[0].mem_type if self.entries else DRAM

    @property
    def device_id(self) -> int:
        return self.entries[0].device_id if self.entries else 0

    @property
    def layers(self) -> list[int]:
        return sorted({e.layer for e in self.entries})

    @property
    def kinds(self) -> list[str]:
        return sorted({e.kind for e in self.entries})

    def to_wire(self) -> list[dict[str, Any]]:
        return [e.to_wire() for e in self.entries]

    @classmethod
    def from_wire(cls, rows: list[dict[str, Any]]) -> "RegionTable":
        return cls(tuple(RegionEntry.from_wire(r) for r in rows))


def region_entry(region: CacheRegionLike) -> RegionEntry:
    """Validate one region and describe it; raises `RegionError` naming the region."""
    t = region.tensor
    where = f"region (layer={region.layer}, kind={region.kind!r})"
    if not isinstance(region.kind, str) or not region.kind:
        raise RegionError(f"{where}: kind must be a non-empty str")
    if region.num_pages <= 0 or region.bytes_per_page <= 0:
        raise RegionError(f"{where}: num_pages and bytes_per_page must be > 0")
    if t.dim() < 1 or int(t.shape[0]) != region.num_pages:
        raise RegionError(f"{where}: tensor dim 0 is {tuple(t.shape)[:1]}, expected num_pages={region.num_pages}")
    if not t.is_contiguous():
        # A page must be bytes_per_page contiguous bytes at a fixed stride.
        raise RegionError(f"{where}: tensor must be contiguous")
    if t.nbytes != region.num_pages * region.bytes_per_page:
        raise RegionError(
            f"{where}: tensor has {t.nbytes} bytes, expected num_pages * bytes_per_page = "
            f"{region.num_pages} * {region.bytes_per_page}"
        )
    if t.device.type == "cuda":
        mem_type, device_id = VRAM, int(t.device.index or 0)
    elif t.device.type == "cpu":
        mem_type, device_id = DRAM, 0
    else:
        raise RegionError(f"{where}: unsupported device {t.device}")
    return RegionEntry(
        layer=int(region.layer),
        kind=region.kind,
        base_addr=int(t.data_ptr()),
        bytes_per_page=int(region.bytes_per_page),
        num_pages=int(region.num_pages),
        mem_type=mem_type,
        device_id=device_id,
    )


def region_table(regions: Iterable[CacheRegionLike]) -> RegionTable:
    """Region table of ``regions`` (validated; order kept)."""
    entries = tuple(region_entry(r) for r in regions)
    if not entries:
        raise RegionError("no regions to register")
    return RegionTable(entries)
