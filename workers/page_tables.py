"""Pages of a model whose caches come in groups (DeepSeek-V4): one page table per
request, one page pool per group.

`PageTable` is what such a request holds (``Request.page_table``; a plain
``list[int]`` for the one-group caches of DeepSeek-V3.2 / GLM-5), and
`GroupPagePools` allocates and frees every group's pages of it through the
same calls the scheduler makes on a ``PagePool`` (``fits_ever``, ``grow``,
``acquire_tokens``, ``free``), so the scheduler and the engine hold no V4
special case. How many pages a sequence of ``n`` tokens needs in a group:

* ``swa``: every page of positions ``[0, n)``: pages older than the window are
  kept, not freed (simple, and a request's pages stay one list per group; the
  cost is ``n`` keys' memory instead of ``window``'s; ``models.v4.paged_state``);
* ``compressed`` / ``indexer``: pages of entries ``[0, n // ratio)``;
* ``state``: one page; with a prefix cache, the CSA state groups one more per
  256-token cut (each cut's state: `workers.v4_prefix`).

With a prefix cache (`workers.v4_prefix.V4PrefixCache`) a table's leading pages
may be shared with the cache and other requests (read-only); a cached page only
the cache references is counted free until an allocation evicts it.

For the transfer a table is one list of unit ids (`transfer_ids`,
``attention.group_cache``): the groups' pages in group order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from attention.cache_groups import CacheGroup
from attention.formats import PAGE_SIZE
from attention.group_cache import GroupedPagedCache
from workers.page_pool import PagePool, PoolExhausted
from workers.v4_prefix import V4PrefixCache, cut_tokens


@dataclass
class PageTable:
    """A request's pages in every cache group: group name -> page ids, in position order."""

    pages: dict[str, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return any(self.pages.values())

    def __len__(self) -> int:
        """Pages over every group."""
        return sum(len(p) for p in self.pages.values())

    def frozen(self) -> dict[str, tuple[int, ...]]:
        """A snapshot for one forward (the table may grow after it)."""
        return {g: tuple(p) for g, p in self.pages.items()}


def frozen_pages(page_table) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
    """A request's page table as a forward takes it: a tuple (one group) or `PageTable.frozen`."""
    return page_table.frozen() if isinstance(page_table, PageTable) else tuple(page_table)


def group_pages_for_tokens(group: CacheGroup, num_tokens: int) -> int:
    """Pages of ``group`` a sequence of ``num_tokens`` tokens holds in this engine (module docstring): the
    one rule the pools, the scheduler and the controller use. It differs from
    ``CacheGroup.pages_for_tokens`` for ``swa`` only: that counts the window's pages (what an engine that
    frees older pages would hold); this engine keeps them."""
    if num_tokens <= 0:
        return 0
    if group.kind == "state":
        return 1
    positions = num_tokens if group.kind == "swa" else num_tokens // group.ratio
    return -(-positions // group.tokens_per_page)


def group_tokens_for_pages(group: CacheGroup, pages: int) -> int | None:
    """The most tokens a sequence may have while ``group_pages_for_tokens(group, n) <= pages`` (its inverse:
    what a pool of ``pages`` pages holds for one request); None: any length (a ``state`` group's one page)."""
    pages = max(pages, 0)
    if group.kind == "state":
        return None if pages else 0
    if group.kind == "swa":
        return pages * group.tokens_per_page
    # n // ratio entries fit while n // ratio <= pages * tokens_per_page
    return (pages * group.tokens_per_page + 1) * group.ratio - 1


class GroupPagePools:
    """One `PagePool` per group of ``cache`` (its page counts), and the groups' prefix cache when
    ``prefix`` is given (`workers.v4_prefix.V4PrefixCache`: cuts every 256 tokens, each cut's state in
    pages of its own). Pages the cache alone references are reclaimable: counted free, returned to their
    pool (least recently used cut first) when an allocation needs them."""

    def __init__(self, cache: GroupedPagedCache, prefix: V4PrefixCache | None = None):
        self.cache = cache
        self.groups = {g.name: g for g in cache.groups}
        self.pools = {name: PagePool(n) for name, n in cache.num_pages.items()}
        self.prefix_cache = prefix
        # Per group: the cached pages no request references (the cache's reference is their only one).
        self._solo: dict[str, set[int]] = {g: set() for g in self.groups}

    @property
    def cached_count(self) -> int:
        """Pages the prefix cache holds, over every group (0 without one)."""
        return len(self.prefix_cache) if self.prefix_cache is not None else 0

    # -- what the scheduler asks ---------------------------------------------------------

    def need(self, num_tokens: int) -> dict[str, int]:
        """Pages per group of a sequence of ``num_tokens`` tokens."""
        if self.prefix_cache is not None:
            return {name: self.prefix_cache.pages_for_tokens(g, num_tokens) for name, g in self.groups.items()}
        return {name: group_pages_for_tokens(g, num_tokens) for name, g in self.groups.items()}

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether an empty pool could hold one sequence of ``num_tokens`` tokens."""
        return all(n <= self.pools[g].num_pages for g, n in self.need(num_tokens).items())

    def capacity_error(self, num_tokens: int) -> str | None:
        """Why a sequence of ``num_tokens`` tokens can never fit, or None."""
        over = [f"{g}: {n} > {self.pools[g].num_pages}" for g, n in self.need(num_tokens).items()
                if n > self.pools[g].num_pages]
        return None if not over else f"{num_tokens} tokens need more pages than the pool holds ({', '.join(over)})"

    def grow(self, table: PageTable, num_tokens: int) -> bool:
        """Give ``table`` the pages of ``num_tokens`` tokens in every group, all or nothing."""
        missing = {g: n - len(table.pages.get(g, ())) for g, n in self.need(num_tokens).items()}
        if any(k > self._free(g) for g, k in missing.items() if k > 0):
            return False
        for g, k in missing.items():
            if k > 0:
                table.pages.setdefault(g, []).extend(self._allocate(g, k))
        return True

    def acquire_tokens(self, token_ids: Sequence[int], hold_tokens: int, reuse: bool = True) -> tuple[PageTable, int]:
        """A table with the pages of ``hold_tokens`` tokens for a request about to compute ``token_ids``:
        with a prefix cache (and ``reuse``) the pages of its longest cached prefix ending at a cut before
        its last token (`workers.v4_prefix`: shared read-only; the pages straddling the cut and the cut's
        state copied into fresh ones), fresh pages for the rest. Returns ``(table, cached)``, ``cached`` the
        64-token pages of the prefix reused (the request computes from ``cached * 64``); counts the lookup.
        Raises `PoolExhausted` with nothing taken."""
        cache = self.prefix_cache
        need = self.need(hold_tokens)
        hit = cache.match(token_ids, len(token_ids) - 1) if cache is not None and reuse else None
        shared: dict[str, dict[int, int]] = {g: {} for g in self.groups}
        copies: dict[str, tuple[int, int]] = {}
        if hit is not None:
            shared, copies = cache.hit_pages(hit)
        # Pinned while the fresh pages are taken: what the table shares and what is copied (an eviction
        # for the fresh pages must not hand a copy's source out before it is read).
        pinned = {g: list(shared[g].values()) + ([copies[g][1]] if g in copies else []) for g in self.groups}
        fresh = {g: n - len(shared[g]) for g, n in need.items()}
        short = {g: k for g, k in fresh.items() if k > self._free(g) - len(self._solo[g].intersection(pinned[g]))}
        if short:
            raise PoolExhausted(f"{hold_tokens} tokens need {need} pages ({sum(map(len, shared.values()))} "
                                f"cached); free {self.free_counts()}")
        for g, pages in pinned.items():
            self._share(g, pages)
        table = PageTable({})
        for g, n in need.items():
            new = iter(self._allocate(g, fresh[g]))
            table.pages[g] = [shared[g][i] if i in shared[g] else next(new) for i in range(n)]
        view = self.cache.view
        for g, (i, src) in copies.items():
            view(g)[table.pages[g][i]] = view(g)[src]
            self._release(g, [src])  # the pin
        if cache is not None:
            cache.counters.queries += len(token_ids)
            cache.counters.hits += hit.cut if hit is not None else 0
        return table, (hit.cut // PAGE_SIZE if hit is not None else 0)

    def allocate_for_tokens(self, num_tokens: int) -> PageTable:
        """A fresh table for ``num_tokens`` tokens (`PagePool.allocate_for_tokens`' counterpart)."""
        return self.acquire_tokens((), num_tokens, reuse=False)[0]

    publishes = False
    """A grouped cache keeps a prompt's cut states when the request releases them (`workers.v4_prefix`), not
    while it runs: `publish` caches nothing."""

    def publish(self, token_ids, pages, valid_tokens: int) -> int:
        return 0

    def free(self, table: PageTable, token_ids=None, valid_tokens: int = 0) -> None:
        """Drop ``table``'s references (one per page); with ``token_ids`` and a prefix cache, its cuts
        ``<= valid_tokens`` (positions written in every group) are cached first."""
        if token_ids is not None and self.prefix_cache is not None:
            for g, p in self.prefix_cache.insert(token_ids, table.pages, valid_tokens):
                self._share(g, [p])  # the cache's reference
        for g, pages in table.pages.items():
            self._release(g, pages)
        table.pages = {}

    def free_cached(self, table: PageTable, cached: int) -> None:
        """Drop a request's references to the pages it shares from the prefix cache (a hit of ``cached``
        64-token pages): what `transfer_plan` leaves out; the rest are a receive's to give back."""
        if cached:
            for g, idx in self._shared_indices(cached).items():
                self._release(g, [table.pages[g][i] for i in idx])
        table.pages = {}

    def clear_prefix_cache(self) -> None:
        """Forget every cached cut (a restarted cache; tests): pages only the cache referenced return to
        their pools, pages requests hold stay theirs."""
        if self.prefix_cache is not None:
            for g, p in self.prefix_cache.clear():
                self._solo[g].discard(p)
                self.pools[g].free([p])

    # -- references ------------------------------------------------------------------------

    def _free(self, g: str) -> int:
        return self.pools[g].free_count + len(self._solo[g])

    def _allocate(self, g: str, n: int) -> list[int]:
        """``n`` fresh pages of group ``g``, evicting cached cuts (least recently used first) while too few
        are free."""
        while self.pools[g].free_count < n and self.prefix_cache is not None and self.prefix_cache.num_cuts:
            for g2, p in self.prefix_cache.evict():
                self._solo[g2].discard(p)
                self.pools[g2].free([p])
        return self.pools[g].allocate(n)

    def _share(self, g: str, pages: Sequence[int]) -> None:
        self.pools[g].share(pages)
        self._solo[g].difference_update(pages)

    def _release(self, g: str, pages: Sequence[int]) -> None:
        self.pools[g].free(list(pages))
        cache = self.prefix_cache
        if cache is not None:
            pool = self.pools[g]
            self._solo[g].update(p for p in pages if cache.holds(g, p) and pool.refs(p) == 1)

    def _shared_indices(self, cached: int) -> dict[str, range]:
        """Per group, the page indices a hit of ``cached`` 64-token pages shares."""
        cut = cached * PAGE_SIZE
        if self.prefix_cache is None or cut % self.prefix_cache.cut:
            raise ValueError(f"{cached} cached pages ({cut} tokens) is not a cut of this cache"
                             + ("" if self.prefix_cache is not None else " (no prefix cache)"))
        return {g: self.prefix_cache.shared_indices(grp, cut) for g, grp in self.groups.items()}

    # -- the transfer's view ----------------------------------------------------------------

    pushes_by_chunk = False
    """The state pages are final only after a prompt's last chunk: prefill pushes the whole table then."""

    def transfer_plan(self, table: PageTable, num_tokens: int, skip_pages: int) -> tuple[list[int], int]:
        """`transfer_ids` and `transfer_tokens` of ``table``, a prompt of ``num_tokens`` tokens, when the
        receiving side shares ``skip_pages`` 64-token pages of it from its prefix cache (a cut, or 0): the
        pages such a hit shares (`workers.v4_prefix.V4PrefixCache.shared_indices`) are left out, on both
        sides alike (their tables have the same shape), so a shared page is never written."""
        self.check_skip(num_tokens, skip_pages)
        ids = self.transfer_ids(table, self._shared_indices(skip_pages) if skip_pages else None)
        return ids, self.transfer_tokens(ids)

    def check_skip(self, num_tokens: int, skip_pages: int) -> None:
        """Raises ``ValueError`` unless a receiver may share ``skip_pages`` 64-token pages of a prompt of
        ``num_tokens`` tokens: 0, or a cut (`workers.v4_prefix.cut_tokens`) before its last token."""
        if skip_pages and (skip_pages < 0 or skip_pages * PAGE_SIZE > num_tokens - 1
                           or skip_pages * PAGE_SIZE % cut_tokens(self.cache.groups)):
            raise ValueError(f"{skip_pages} cached pages of a {num_tokens}-token prompt: not a cut of every cache "
                             f"group ({cut_tokens(self.cache.groups)} tokens) before its last token")

    def transfer_ids(self, table: PageTable, skip: Mapping[str, range] | None = None) -> list[int]:
        """The table as the transfer pushes it: unit ids of every group's pages (but the indices ``skip``
        lists per group), groups in cache order."""
        out: list[int] = []
        for g in self.groups:
            pages = table.pages.get(g, ())
            if skip is not None and skip[g]:
                pages = [p for i, p in enumerate(pages) if i not in skip[g]]
            out += self.cache.units(g, pages)
        return out

    @staticmethod
    def transfer_tokens(ids: Sequence[int]) -> int:
        """The "prompt length" the transfer layer takes for pushing ``ids``: it counts ``PAGE_SIZE``
        positions per page id, and every unit of a grouped table is final only after the prompt's
        last chunk (the state pages), so the whole list moves as one chunk."""
        return len(ids) * PAGE_SIZE

    def reserve_warmup(self) -> int:
        """A transfer id no request ever uses (prefill's warm-up WRITE of a new pair lands there): the first
        unit of a page taken, for good, from the group whose page is smallest."""
        name = min(self.groups, key=lambda g: self.cache.layouts[g].units_per_page)
        return self.cache.units(name, self.pools[name].allocate(1))[0]

    def free_transfer_ids(self, ids: Sequence[int]) -> None:
        """Free the pages whose units ``ids`` lists (a receive that ended without its KV)."""
        for g, pages in self.cache.pages_of_units(ids).items():
            self._release(g, pages)

    # -- counts -----------------------------------------------------------------------------

    def free_counts(self) -> dict[str, int]:
        """Per group, pages an allocation can take: free ones and cached ones only the cache references."""
        return {g: self._free(g) for g in self.pools}

    @property
    def free_count(self) -> int:
        """Free pages over every group, reclaimable cached ones included (the pool is whole when this
        equals `num_pages`)."""
        return sum(self.free_counts().values())

    @property
    def num_pages(self) -> int:
        return sum(p.num_pages for p in self.pools.values())

    @property
    def held_count(self) -> int:
        return 0

    def hold_frees(self, tag) -> None:  # overlap scheduling is off for grouped caches (`V4ModelRunner`)
        if tag is not None:
            raise RuntimeError("grouped caches do not hold frees: overlap scheduling is off for them")

    def release_held(self, through=None) -> None:
        pass
