"""Transfer plans: which bytes go where for one chunk of one request.

A request owns the same *positions* on both sides: position ``i`` is prefill
page ``local_pages[i]`` and decode page ``remote_pages[i]``, in every region
(layer x kind). A plan turns that pairing into NIXL descriptors
``(address, length, device_id)``, one per (region, page), then merges runs
that are contiguous on *both* sides into one descriptor: a fresh pool hands
out ascending page ids, so a whole request in one region is often a single
descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from attention.formats import PAGE_SIZE, pages_for_tokens
from transfer.errors import PlanError
from transfer.regions import RegionTable


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
    if arr.size and arr.min() < 0:
        raise PlanError(f"{side} pages contain a negative id")
    if np.unique(arr).size != arr.size:
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
        raise PlanError(f"no region for layers {sorted(missing)}")
    if want_k is not None and (missing := want_k - {k[1] for k in keys}):
        raise PlanError(f"no region of kinds {sorted(missing)}")
    return keys


def check_pages(
    local: RegionTable,
    remote: RegionTable,
    local_pages: Sequence[int] | np.ndarray,
    remote_pages: Sequence[int] | np.ndarray,
    *,
    layers: Optional[Iterable[int]] = None,
    kinds: Optional[Iterable[str]] = None,
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, str]]]:
    """Validate a page pairing without building descriptors; returns (local, remote, region keys).

    Raises `PlanError` on unequal page counts, out-of-range or duplicate
    pages, regions missing on the peer or differing page sizes.
    """
    lp = _as_pages(local_pages, "local")
    rp = _as_pages(remote_pages, "remote")
    if lp.size != rp.size:
        raise PlanError(f"{lp.size} local pages but {rp.size} remote pages")
    keys = select_regions(local, layers, kinds)
    lmax = int(lp.max()) if lp.size else -1
    rmax = int(rp.max()) if rp.size else -1
    for key in keys:
        if key not in remote:
            raise PlanError(f"peer has no region (layer={key[0]}, kind={key[1]!r})")
        le, re_ = local.get(*key), remote.get(*key)
        if le.bytes_per_page != re_.bytes_per_page:
            raise PlanError(
                f"region (layer={key[0]}, kind={key[1]!r}): {le.bytes_per_page} bytes per page locally, "
                f"{re_.bytes_per_page} on the peer"
            )
        if lmax >= le.num_pages:
            raise PlanError(f"local page {lmax} out of range for {le.num_pages} pages")
        if rmax >= re_.num_pages:
            raise PlanError(f"remote page {rmax} out of range for {re_.num_pages} pages")
    return lp, rp, keys


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
    Raises `PlanError` as `check_pages` does.
    """
    lp, rp, keys = check_pages(local, remote, local_pages, remote_pages, layers=layers, kinds=kinds)

    # Rows ordered region-major, then by page position: [regions, pages] flattened.
    bpp = np.array([local.get(*k).bytes_per_page for k in keys], dtype=np.int64)[:, None]
    lbase = np.array([local.get(*k).base_addr for k in keys], dtype=np.int64)[:, None]
    rbase = np.array([remote.get(*k).base_addr for k in keys], dtype=np.int64)[:, None]
    src = (lbase + lp[None, :] * bpp).reshape(-1)
    dst = (rbase + rp[None, :] * bpp).reshape(-1)
    length = np.broadcast_to(bpp, (len(keys), lp.size)).reshape(-1)

    if merge and src.size > 1:
        # Row i continues row i-1 iff it starts where i-1 ends on both sides.
        cont = np.zeros(src.size, dtype=bool)
        cont[1:] = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
        starts = np.flatnonzero(~cont)
        length = np.add.reduceat(length, starts)
        src, dst = src[starts], dst[starts]

    def rows(addr: np.ndarray, dev: int) -> np.ndarray:
        out = np.empty((addr.size, 3), dtype=np.uint64)
        out[:, 0] = addr
        out[:, 1] = length
        out[:, 2] = dev
        return out

    return TransferPlan(
        src=rows(src, local.device_id),
        dst=rows(dst, remote.device_id),
        src_mem=local.mem_type,
        dst_mem=remote.mem_type,
        num_pages=int(lp.size),
        nbytes=int(length.sum()),
        merged=merge,
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
