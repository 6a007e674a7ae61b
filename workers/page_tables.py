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
* ``state``: one page.

For the transfer a table is one list of unit ids (`transfer_ids`,
``attention.group_cache``): the groups' pages in group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from attention.cache_groups import CacheGroup
from attention.formats import PAGE_SIZE
from attention.group_cache import GroupedPagedCache
from workers.page_pool import PagePool, PoolExhausted


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
    """One `PagePool` per group of ``cache`` (its page counts). No prefix cache: V4's state pages
    are per sequence (a cached prefix would need its state at the prefix's end)."""

    prefix_cache = None
    cached_count = 0

    def __init__(self, cache: GroupedPagedCache):
        self.cache = cache
        self.groups = {g.name: g for g in cache.groups}
        self.pools = {name: PagePool(n) for name, n in cache.num_pages.items()}

    # -- what the scheduler asks ---------------------------------------------------------

    def need(self, num_tokens: int) -> dict[str, int]:
        """Pages per group of a sequence of ``num_tokens`` tokens."""
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
        if any(k > self.pools[g].free_count for g, k in missing.items() if k > 0):
            return False
        for g, k in missing.items():
            if k > 0:
                table.pages.setdefault(g, []).extend(self.pools[g].allocate(k))
        return True

    def acquire_tokens(self, token_ids: Sequence[int], hold_tokens: int, reuse: bool = True) -> tuple[PageTable, int]:
        """A fresh table with the pages of ``hold_tokens`` tokens; ``(table, 0)`` (nothing is cached).
        Raises `PoolExhausted` with nothing taken."""
        table = PageTable({g: [] for g in self.groups})
        if not self.grow(table, hold_tokens):
            raise PoolExhausted(f"{hold_tokens} tokens need {self.need(hold_tokens)} pages; free {self.free_counts()}")
        return table, 0

    def allocate_for_tokens(self, num_tokens: int) -> PageTable:
        """A fresh table for ``num_tokens`` tokens (`PagePool.allocate_for_tokens`' counterpart)."""
        return self.acquire_tokens((), num_tokens)[0]

    def free(self, table: PageTable, token_ids=None, valid_tokens: int = 0) -> None:
        for g, pages in table.pages.items():
            self.pools[g].free(pages)
        table.pages = {}

    # -- the transfer's view ----------------------------------------------------------------

    pushes_by_chunk = False
    """The state pages are final only after a prompt's last chunk: prefill pushes the whole table then."""

    def transfer_plan(self, table: PageTable, num_tokens: int, skip_pages: int) -> tuple[list[int], int]:
        """`transfer_ids` and `transfer_tokens` of ``table`` (``skip_pages`` must be 0: no prefix cache)."""
        if skip_pages:
            raise ValueError("a grouped cache has no prefix cache: nothing is skipped")
        ids = self.transfer_ids(table)
        return ids, self.transfer_tokens(ids)

    def transfer_ids(self, table: PageTable) -> list[int]:
        """The table as the transfer pushes it: unit ids of every group's pages, groups in cache order."""
        return [u for g in self.groups for u in self.cache.units(g, table.pages.get(g, ()))]

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
            self.pools[g].free(pages)

    # -- counts -----------------------------------------------------------------------------

    def free_counts(self) -> dict[str, int]:
        return {g: p.free_count for g, p in self.pools.items()}

    @property
    def free_count(self) -> int:
        """Free pages over every group (the pool is whole when this equals `num_pages`)."""
        return sum(p.free_count for p in self.pools.values())

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
