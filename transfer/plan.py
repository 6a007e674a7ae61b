"""Transfer plans: which bytes go where for one chunk of one request.

A request owns the same *positions* on both sides: position ``i`` is prefill
page ``local_pages[i]`` and decode page ``remote_pages[i]``, in every region
(layer x kind). `PageRuns` cuts that pairing into runs of positions
contiguous on *both* sides (the page pool hands out runs, so a request is
usually one or a few). Two ways to hand a chunk to NIXL:

- `TransferPlan` (`descriptor_plan`): explicit descriptors ``(address,
  length, device_id)``, one per (region, run), posted with
  ``initialize_xfer``. Serving uses it while a chunk needs at most
  `transfer.push.EXPLICIT_MAX_DESCRIPTORS`: a 32k-token DeepSeek-V3.2
  request in one run is one descriptor on the cross-layer cache (one
  region), cut into 32 by `PageRuns.split` to spread over NIXL's posting
  threads, or 61 on the per-layer cache, built from a few small arrays.
- `IndexPlan` (`index_plan`): indices into descriptor lists prepared once
  over every page of every region (`RegionTable.first_index`), locally at
  agent start and per peer at handshake; a WRITE is then
  ``make_prepped_xfer(local_idx, remote_idx)`` and NIXL merges index runs
  consecutive on both sides itself (``merge=False`` asks it not to). One
  index per (region, page): cheaper than explicit rows only for fragmented
  pages (thousands of runs).

Either way a run never spans two regions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from attention.cache import ALL_LAYERS
from attention.formats import PAGE_SIZE, pages_for_tokens
from transfer.errors import PlanError
from transfer.regions import RegionKey, RegionTable

_INDEX_LIMIT = 2**31
"""NIXL takes int32 indices: a flat page index must stay below this."""


@dataclass(frozen=True)
class TransferPlan:
    """Descriptors of one WRITE, local (source) and remote (destination) side.

    ``src`` / ``dst``: uint64 ``[n, 3]`` rows ``(address, nbytes, device_id)``,
    row ``j`` of ``src`` is copied to row ``j`` of ``dst`` (same length).
    ``num_pages``: page positions covered; ``nbytes``: total bytes moved.
    """

    src: np.ndarray
    dst: np.ndarray
    src_mem: str
    dst_mem: str
    num_pages: int
    nbytes: int
    merged: bool

    @property
    def num_descriptors(self) -> int:
        return int(self.src.shape[0])

    def __len__(self) -> int:
        return self.num_descriptors


def _as_pages(pages: Sequence[int] | np.ndarray, side: str) -> np.ndarray:
    arr = np.asarray(pages, dtype=np.int64).reshape(-1)
    if arr.size < 2:
        if arr.size and arr[0] < 0:
            raise PlanError(f"{side} pages contain a negative id")
        return arr
    step = np.diff(arr)
    # Ascending ids (what the page pool hands out) need no sort to rule out duplicates.
    ordered = arr if (step > 0).all() else np.sort(arr)
    if ordered[0] < 0:
        raise PlanError(f"{side} pages contain a negative id")
    if ordered is not arr and (ordered[1:] == ordered[:-1]).any():
        # A page listed twice would be written twice from different sources.
        raise PlanError(f"{side} pages contain duplicates")
    return arr


def select_regions(
    table: RegionTable, layers: Optional[Iterable[int]] = None, kinds: Optional[Iterable[str]] = None
) -> list[tuple[int, str]]:
    """Keys of ``table`` restricted to ``layers`` / ``kinds`` (None = all), table order.

    Raises `PlanError` if a requested layer or kind has no region at all.
    """
    want_l = None if layers is None else set(layers)
    want_k = None if kinds is None else set(kinds)
    keys = [k for k in table.keys() if (want_l is None or k[0] in want_l) and (want_k is None or k[1] in want_k)]
    if want_l is not None and (missing := want_l - {k[0] for k in keys}):
        if any(k[0] == ALL_LAYERS for k in table.keys()):
            raise PlanError(f"no region for layers {sorted(missing)}: a cross_layer cache has one region per "
                            f"kind whose page carries every layer (layer {ALL_LAYERS}); push every layer "
                            f"(layers=None)")
        raise PlanError(f"no region for layers {sorted(missing)}")
    if want_k is not None and (missing := want_k - {k[1] for k in keys}):
        raise PlanError(f"no region of kinds {sorted(missing)}")
    return keys


def _check_region_pair(local: RegionTable, remote: RegionTable, key: RegionKey):
    if key not in remote:
        raise PlanError(f"peer has no region (layer={key[0]}, kind={key[1]!r})")
    le, re_ = local.get(*key), remote.get(*key)
    if le.bytes_per_page != re_.bytes_per_page:
        raise PlanError(
            f"region (layer={key[0]}, kind={key[1]!r}): {le.bytes_per_page} bytes per page locally, "
            f"{re_.bytes_per_page} on the peer"
        )
    return le, re_


@dataclass(frozen=True)
class PageRuns:
    """A page pairing as runs of positions consecutive on *both* sides.

    ``local`` / ``remote`` / ``length``: int64 ``[r]``; run ``j`` pairs local
    pages ``local[j] .. local[j] + length[j] - 1`` with remote pages
    ``remote[j] ..`` in the same order. ``merged``: built with ``merge=True``;
    with ``merge=False`` every run is one page. The one place that decides what "contiguous on both sides" means:
    explicit descriptors are these runs, and NIXL's own merge of prepared
    indices finds the same ones (`IndexPlan.num_descriptors`).
    """

    local: np.ndarray
    remote: np.ndarray
    length: np.ndarray
    merged: bool = True

    @classmethod
    def of(cls, local_pages: np.ndarray, remote_pages: np.ndarray, merge: bool = True) -> "PageRuns":
        lp = np.asarray(local_pages, dtype=np.int64).reshape(-1)
        rp = np.asarray(remote_pages, dtype=np.int64).reshape(-1)
        if not merge or lp.size < 2:
            return cls(lp, rp, np.ones(lp.size, dtype=np.int64), merge)
        cont = (lp[1:] == lp[:-1] + 1) & (rp[1:] == rp[:-1] + 1)
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        length = np.diff(np.append(starts, lp.size))
        return cls(lp[starts], rp[starts], length)

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def num_pages(self) -> int:
        return int(self.length.sum())

    def split(self, max_pages: Optional[int]) -> "PageRuns":
        """The same pairing with no run longer than ``max_pages`` (None: unchanged).

        NIXL's UCX backend spreads one WRITE's descriptors over its posting
        threads, each copying on its own stream; a single long run is one
        copy on one stream.
        """
        if max_pages is None or not len(self) or int(self.length.max()) <= max_pages:
            return self
        if max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        pieces = -(-self.length // max_pages)
        run = np.repeat(np.arange(len(self)), pieces)
        # Position of each piece within its run: 0, 1, ... per run.
        k = np.arange(run.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        offset = k * max_pages
        length = np.minimum(self.length[run] - offset, max_pages)
        return PageRuns(self.local[run] + offset, self.remote[run] + offset, length, self.merged)


@dataclass(frozen=True)
class RegionSelection:
    """The regions one pusher sends to one peer, paired and vectorised (computed once per peer).

    Per selected region, in local table order, int64 ``[k]``: ``local_first``
    / ``remote_first`` (flat index of page 0 on each side,
    `RegionTable.first_index`), ``local_base`` / ``remote_base`` (address of
    page 0), ``bytes_per_page``. ``local_pages`` / ``remote_pages``: the
    fewest pages any selected region has on that side (the page-id bound).
    ``bytes_per_position``: bytes one page position moves over all selected
    regions. ``remote``: the peer table all of this refers to (a WRITE must
    use the descriptor list prepared from this very table).
    """

    keys: tuple[RegionKey, ...]
    local_first: np.ndarray
    remote_first: np.ndarray
    local_base: np.ndarray
    remote_base: np.ndarray
    bytes_per_page: np.ndarray
    local_pages: int
    remote_pages: int
    bytes_per_position: int
    remote: RegionTable
    local: RegionTable

    @classmethod
    def of(
        cls,
        local: RegionTable,
        remote: RegionTable,
        layers: Optional[Iterable[int]] = None,
        kinds: Optional[Iterable[str]] = None,
    ) -> "RegionSelection":
        """Raises `PlanError` for a layer / kind with no region, a region missing on the peer or a
        differing page size."""
        keys = select_regions(local, layers, kinds)
        pairs = [_check_region_pair(local, remote, key) for key in keys]
        for side, table in (("local", local), ("remote", remote)):
            if table.total_pages >= _INDEX_LIMIT:
                raise PlanError(f"{side} regions hold {table.total_pages} pages: NIXL indices are int32")

        def arr(values) -> np.ndarray:
            return np.array(list(values), dtype=np.int64)

        return cls(
            keys=tuple(keys),
            local_first=arr(local.first_index(*k) for k in keys),
            remote_first=arr(remote.first_index(*k) for k in keys),
            local_base=arr(le.base_addr for le, _ in pairs),
            remote_base=arr(re_.base_addr for _, re_ in pairs),
            bytes_per_page=arr(le.bytes_per_page for le, _ in pairs),
            local_pages=min((le.num_pages for le, _ in pairs), default=0),
            remote_pages=min((re_.num_pages for _, re_ in pairs), default=0),
            bytes_per_position=int(sum(le.bytes_per_page for le, _ in pairs)),
            remote=remote,
            local=local,
        )

    def check(self, local_pages, remote_pages) -> tuple[np.ndarray, np.ndarray]:
        """Validate one request's page pairing (vectorised); returns it as int64 arrays.

        Raises `PlanError` on unequal counts, negative, duplicate or
        out-of-range page ids.
        """
        lp = _as_pages(local_pages, "local")
        rp = _as_pages(remote_pages, "remote")
        if lp.size != rp.size:
            raise PlanError(f"{lp.size} local pages but {rp.size} remote pages")
        if lp.size and (lmax := int(lp.max())) >= self.local_pages:
            raise PlanError(f"local page {lmax} out of range for {self.local_pages} pages")
        if rp.size and (rmax := int(rp.max())) >= self.remote_pages:
            raise PlanError(f"remote page {rmax} out of range for {self.remote_pages} pages")
        return lp, rp


def descriptor_plan(sel: RegionSelection, runs: PageRuns) -> TransferPlan:
    """Explicit descriptors: one per (selected region, run), region-major, vectorised.

    ``runs`` must come from validated pages (`RegionSelection.check`). A
    request whose pages form few runs (what `workers.page_pool` hands out)
    is ``regions x runs`` descriptors however many pages it has.
    """
    bpp = sel.bytes_per_page[:, None]
    src = (sel.local_base[:, None] + runs.local[None, :] * bpp).reshape(-1)
    dst = (sel.remote_base[:, None] + runs.remote[None, :] * bpp).reshape(-1)
    length = (runs.length[None, :] * bpp).reshape(-1)

    def rows(addr: np.ndarray, dev: int) -> np.ndarray:
        out = np.empty((addr.size, 3), dtype=np.uint64)
        out[:, 0] = addr
        out[:, 1] = length
        out[:, 2] = dev
        return out

    return TransferPlan(
        src=rows(src, sel.local.device_id),
        dst=rows(dst, sel.remote.device_id),
        src_mem=sel.local.mem_type,
        dst_mem=sel.remote.mem_type,
        num_pages=runs.num_pages,
        nbytes=int(length.sum()),
        merged=runs.merged,
    )


def build_plan(
    local: RegionTable,
    remote: RegionTable,
    local_pages: Sequence[int] | np.ndarray,
    remote_pages: Sequence[int] | np.ndarray,
    *,
    layers: Optional[Iterable[int]] = None,
    kinds: Optional[Iterable[str]] = None,
    merge: bool = True,
) -> TransferPlan:
    """Plan copying ``local_pages[i] -> remote_pages[i]`` in every selected region.

    ``merge=False`` keeps one descriptor per (region, page) (for benchmarks).
    Raises `PlanError` as `RegionSelection.of` and `RegionSelection.check` do.
    """
    sel = RegionSelection.of(local, remote, layers, kinds)
    lp, rp = sel.check(local_pages, remote_pages)
    return descriptor_plan(sel, PageRuns.of(lp, rp, merge))


@dataclass(frozen=True)
class IndexPlan:
    """One WRITE as indices into the prepared descriptor lists of both sides.

    ``local_idx`` / ``remote_idx``: int32 ``[regions * pages]``, region-major
    then page position; element ``j`` of ``local_idx`` is copied to element
    ``j`` of ``remote_idx``. ``merged``: let NIXL merge runs consecutive on
    both sides (``skip_desc_merge`` otherwise). ``num_descriptors``: the
    descriptors NIXL will post (`PageRuns` per region, when merged).
    ``remote``: the peer table the remote indices refer to.
    """

    local_idx: np.ndarray
    remote_idx: np.ndarray
    num_pages: int
    nbytes: int
    num_descriptors: int
    merged: bool
    remote: RegionTable

    def __len__(self) -> int:
        return self.num_descriptors


def index_plan(
    sel: RegionSelection,
    local_pages: np.ndarray,
    remote_pages: np.ndarray,
    *,
    merge: bool = True,
    runs: Optional[PageRuns] = None,
) -> IndexPlan:
    """Plan copying ``local_pages[i] -> remote_pages[i]`` in every region of ``sel``, vectorised.

    The pages must already be validated (`RegionSelection.check`, once per
    request): this runs per chunk and only does index arithmetic. ``runs``:
    the pairing's `PageRuns` if the caller has them (for the count).
    """
    lp = np.asarray(local_pages, dtype=np.int64).reshape(-1)
    rp = np.asarray(remote_pages, dtype=np.int64).reshape(-1)
    k, n = len(sel.keys), int(lp.size)
    local_idx = np.ascontiguousarray((sel.local_first[:, None] + lp[None, :]).reshape(-1), dtype=np.int32)
    remote_idx = np.ascontiguousarray((sel.remote_first[:, None] + rp[None, :]).reshape(-1), dtype=np.int32)
    if runs is None:
        runs = PageRuns.of(lp, rp, merge)
    return IndexPlan(
        local_idx=local_idx,
        remote_idx=remote_idx,
        num_pages=n,
        nbytes=n * sel.bytes_per_position,
        num_descriptors=k * len(runs),
        merged=merge,
        remote=sel.remote,
    )


def finished_pages(tokens_done: int, prompt_len: int, page_size: int = PAGE_SIZE) -> int:
    """Pages of a ``prompt_len`` prompt that are final after ``tokens_done`` prompt tokens.

    A page is final when all its tokens are written, or when the prompt is
    complete (the last, partial page). Prefill pushes exactly these after each
    chunk; a page is never pushed before it is final.
    """
    if not 0 <= tokens_done <= prompt_len:
        raise ValueError(f"tokens_done={tokens_done} outside [0, prompt_len={prompt_len}]")
    if tokens_done == prompt_len:
        return pages_for_tokens(prompt_len, page_size)
    return tokens_done // page_size
