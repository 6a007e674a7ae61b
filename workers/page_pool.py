"""The page pool of one replica: page ids shared by every cache (MLA, indexer,
state pages) of every layer, so one id addresses a request's 64 tokens in all
of them."""

from __future__ import annotations

from attention.formats import pages_for_tokens


class PoolExhausted(RuntimeError):
    """Not enough free pages; the message says how many were asked and free."""


class PagePool:
    """Free-list allocator over ``num_pages`` page ids.

    ``free_count`` is exact at all times so tests can assert that every path
    (finish, abort, failure) returns the pool to its starting count.
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        # Low ids first: keeps a fresh request's pages contiguous, which lets
        # the transfer plan merge them into few descriptors.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def allocate_for_tokens(self, num_tokens: int) -> list[int]:
        return self.allocate(pages_for_tokens(num_tokens))

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
        # Return in reverse so the next allocation reuses them in order.
        self._free.extend(sorted(pages, reverse=True))
