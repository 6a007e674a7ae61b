"""The page pool of one replica: page ids shared by every cache (MLA, indexer,
state pages) of every layer, so one id addresses a request's 64 tokens in all
of them."""

from __future__ import annotations

from attention.formats import pages_for_tokens


class PoolExhausted(RuntimeError):
    """Not enough free pages; the message says how many were asked and free."""


class PagePool:
    """Allocator over ``num_pages`` page ids that keeps each request's pages contiguous.

    Why contiguity: a request's pages move prefill -> decode as NIXL
    descriptors per (region, run of pages contiguous on both sides), and
    posting costs per descriptor whatever its size (docs/perf.md): a
    32k-token DeepSeek-V3.2 request in one run is one descriptor on the
    cross-layer cache, one copy (0.88 of the H100's copy bandwidth alone,
    1.02 streamed; docs/perf.md, session 7); in runs of 1-16 pages it is
    ~115 (0.78 / 0.94), and on the per-layer cache thousands (~7,000: 0.065).

    The free pages are kept as maximal runs ``[start, start + length)``.
    `allocate(n)` takes the smallest run that holds all ``n`` pages (lowest
    start among equals: best fit keeps large runs whole for large requests,
    and single-page allocations, such as decode growth, fill holes first),
    from the run's low end. When no run is long enough it takes the fewest
    runs that are: the longest ones, lowest start first among equals, the last
    one best-fit for what is left. The result is in ascending page order.
    `free` merges pages back into their neighbouring runs.

    Cost: `allocate` is O(free runs + n) when one run fits, and O(num_pages)
    when it must combine runs (a bucket pass over run lengths); `free` is
    O(pages freed). Nothing sorts the whole free list.
    ``free_count`` is exact at all times so tests can assert that every path
    (finish, abort, failure) returns the pool to its starting count.
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._run_len: dict[int, int] = {0: num_pages}  # run start -> length
        self._run_at_end: dict[int, int] = {num_pages: 0}  # run end (exclusive) -> start
        self._free_count = num_pages
        self._used: set[int] = set()
        # Frees held back while a decode step launched without waiting may still
        # write into the pages (`hold_frees`): (tag of the newest such step, pages).
        self._hold_tag: int | None = None
        self._held: list[tuple[int, list[int]]] = []

    @property
    def free_count(self) -> int:
        return self._free_count

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as ``(start, length)`` runs in ascending order (for tests and stats)."""
        return sorted(self._run_len.items())

    def allocate(self, n: int) -> list[int]:
        """``n`` page ids (ascending), from one contiguous run when any run holds ``n``."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._free_count:
            raise PoolExhausted(f"asked for {n} pages, {self._free_count} of {self.num_pages} free")
        if n == 0:
            return []
        start = self._best_fit(n, self._run_len.items())
        if start is not None:
            pages = self._take(start, n)
        else:
            pieces = sorted(self._fewest_runs(n))
            pages = [p for s, k in pieces for p in self._take(s, k)]
        self._used.update(pages)
        self._free_count -= n
        return pages

    def allocate_for_tokens(self, num_tokens: int) -> list[int]:
        return self.allocate(pages_for_tokens(num_tokens))

    def free(self, pages: list[int]) -> None:
        """Return ``pages``; while frees are held (`hold_frees`), they wait for their step."""
        # Validate everything first: a bad list must not leave the pool half-updated.
        seen: set[int] = set()
        for p in pages:
            if p not in self._used or p in seen:
                raise ValueError(f"page {p} freed twice or never allocated")
            seen.add(p)
        for p in pages:
            self._used.remove(p)
        if self._hold_tag is not None:
            self._held.append((self._hold_tag, list(pages)))
            return
        self._give_back_all(pages)

    def hold_frees(self, tag: int | None) -> None:
        """Hold the pages freed from now on until `release_held` covers ``tag``.

        The engine launches a decode step and reads its result back during
        the next one (overlap scheduling); until a step has run, it may still
        write the KV of a request that ended meanwhile into that request's
        pages, and a page given to a new request could already be receiving
        its KV over NIXL. ``tag``: the newest step in flight; None: free at once.
        """
        self._hold_tag = tag

    def release_held(self, through: int | None = None) -> None:
        """Give back the held pages of steps ``<= through`` (all when None): those steps completed."""
        keep = []
        for tag, pages in self._held:
            if through is None or tag <= through:
                self._give_back_all(pages)
            else:
                keep.append((tag, pages))
        self._held = keep

    @property
    def held_count(self) -> int:
        """Pages freed but held back for a step still in flight (neither used nor free)."""
        return sum(len(p) for _, p in self._held)

    def _give_back_all(self, pages: list[int]) -> None:
        for p in pages:
            self._give_back(p)
        self._free_count += len(pages)

    # -- runs ---------------------------------------------------------------------

    @staticmethod
    def _best_fit(n: int, runs) -> int | None:
        """Start of the shortest run of ``runs`` ((start, length) pairs) holding ``n`` pages, lowest start first."""
        best = None  # (length, start)
        for s, k in runs:
            if k >= n and (best is None or (k, s) < best):
                best = (k, s)
        return None if best is None else best[1]

    def _fewest_runs(self, n: int) -> list[tuple[int, int]]:
        """``(start, count)`` pieces covering ``n`` pages from the fewest runs (no run holds all ``n``).

        Runs are bucketed by length (lengths are <= num_pages), so this is
        O(num_pages); only the buckets visited are sorted (by start, for the
        lowest-address tie-break), and they hold at most the runs taken plus
        one bucket.
        """
        buckets: list[list[int]] = [[] for _ in range(max(self._run_len.values()) + 1)]
        for s, k in self._run_len.items():
            buckets[k].append(s)
        pieces, left = [], n
        taken: set[int] = set()
        for k in range(len(buckets) - 1, 0, -1):
            for s in sorted(buckets[k]):
                if left == 0:
                    break
                if k >= left:
                    # The rest fits in one run: the best fit among those not
                    # taken yet (shorter runs may hold it and keep this one).
                    rest = ((s2, k2) for s2, k2 in self._run_len.items() if s2 not in taken)
                    s_fit = self._best_fit(left, rest)
                    pieces.append((s_fit, left))
                    left = 0
                    break
                pieces.append((s, k))
                taken.add(s)
                left -= k
            if left == 0:
                break
        assert left == 0, "free_count says the pages exist"
        return pieces

    def _take(self, start: int, n: int) -> list[int]:
        """Remove the first ``n`` pages of the run at ``start`` from the free runs."""
        k = self._run_len.pop(start)
        del self._run_at_end[start + k]
        if k > n:
            self._run_len[start + n] = k - n
            self._run_at_end[start + k] = start + n
        return list(range(start, start + n))

    def _give_back(self, p: int) -> None:
        """Add free page ``p`` to the runs, merging with the runs ending at ``p`` and starting at ``p + 1``."""
        start, end = p, p + 1
        left = self._run_at_end.pop(p, None)
        if left is not None:
            start = left
            del self._run_len[left]
        right = self._run_len.pop(p + 1, None)
        if right is not None:
            end = p + 1 + right
            del self._run_at_end[end]
        self._run_len[start] = end - start
        self._run_at_end[end] = start
