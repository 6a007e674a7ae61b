"""The page pool of one replica: page ids shared by every cache (MLA, indexer,
state pages) of every layer, so one id addresses a request's 64 tokens in all
of them."""

from __future__ import annotations

from typing import Sequence

from attention.formats import PAGE_SIZE, pages_for_tokens
from workers.prefix_cache import PrefixCache


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

    With a prefix cache (`workers.prefix_cache`) pages are reference-counted:
    `acquire` gives a request the cached pages of its prompt's longest cached
    prefix (shared, read-only) before fresh ones, and `free` caches a
    request's written full pages before dropping its references. A cached
    page nobody references is parked: counted in ``free_count`` and evicted,
    least recently used first, only when `allocate` finds too few free pages.
    Held frees (`hold_frees`) hold cached pages too, so none is evicted and
    re-used while a step in flight may still touch it.
    """

    def __init__(self, num_pages: int, prefix_cache: PrefixCache | None = None):
        """``prefix_cache``: keep finished requests' full pages for reuse (`workers.prefix_cache`); None: off."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self.prefix_cache = prefix_cache
        self._run_len: dict[int, int] = {0: num_pages}  # run start -> length
        self._run_at_end: dict[int, int] = {num_pages: 0}  # run end (exclusive) -> start
        self._free_count = num_pages  # pages in the runs
        self._refs: dict[int, int] = {}  # page -> requests holding it (> 1 only for shared cached pages)
        # Frees held back while a decode step launched without waiting may still
        # write into the pages (`hold_frees`): the tag of the newest such step, page -> its tag.
        self._hold_tag: int | None = None
        self._held: dict[int, int] = {}

    @property
    def free_count(self) -> int:
        """Pages an allocation can take now: free ones, and cached pages no request references (reclaimable,
        never leaked: a pool with no live request is back at ``num_pages``)."""
        return self._free_count + (self.prefix_cache.parked_count if self.prefix_cache is not None else 0)

    @property
    def cached_count(self) -> int:
        """Pages the prefix cache holds (shared by requests or parked); 0 without a cache."""
        return len(self.prefix_cache) if self.prefix_cache is not None else 0

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as ``(start, length)`` runs in ascending order (for tests and stats)."""
        return sorted(self._run_len.items())

    def allocate(self, n: int) -> list[int]:
        """``n`` page ids (ascending), from one contiguous run when any run holds ``n``; parked cached pages
        are evicted (least recently used first) when the free ones are too few."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.free_count:
            raise PoolExhausted(f"asked for {n} pages, {self.free_count} of {self.num_pages} free")
        if n == 0:
            return []
        while self._free_count < n:
            self._give_back_all(self.prefix_cache.evict())
        start = self._best_fit(n, self._run_len.items())
        if start is not None:
            pages = self._take(start, n)
        else:
            pieces = sorted(self._fewest_runs(n))
            pages = [p for s, k in pieces for p in self._take(s, k)]
        for p in pages:
            self._refs[p] = 1
        self._free_count -= n
        return pages

    def allocate_for_tokens(self, num_tokens: int) -> list[int]:
        return self.allocate(pages_for_tokens(num_tokens))

    def acquire(self, token_ids: Sequence[int], num_pages: int, reuse: bool = True) -> tuple[list[int], int]:
        """``num_pages`` pages for a request about to compute ``token_ids`` (its prompt, or all it must
        re-prefill): the cached pages of its longest cached prefix first (shared: referenced, never written),
        then fresh ones. At most the pages before ``token_ids``' last token are reused: it is computed (its
        logits give the next token). ``reuse`` False (or no cache): fresh pages only. Returns ``(pages,
        cached)``, ``cached`` the leading pages reused; counts the lookup in the cache's counters. Raises
        `PoolExhausted` with nothing taken."""
        cache = self.prefix_cache
        hit: list[int] = []
        if cache is not None and reuse:
            hit = cache.match(token_ids, min(num_pages, (len(token_ids) - 1) // PAGE_SIZE))
        need = num_pages - len(hit)
        # Parked hits count as free now and stop counting once shared.
        if need > self.free_count - sum(cache.is_parked(p) for p in hit):
            raise PoolExhausted(f"asked for {need} pages ({len(hit)} more cached), {self.free_count} of "
                                f"{self.num_pages} free")
        self.share(hit)
        pages = hit + self.allocate(need)
        if cache is not None:
            cache.counters.queries += len(token_ids)
            cache.counters.hits += len(hit) * PAGE_SIZE
        return pages, len(hit)

    publishes = True
    """`publish` caches a request's pages while it still holds them (a grouped pool caches at release only)."""

    def publish(self, token_ids: Sequence[int], pages: Sequence[int], valid_tokens: int) -> int:
        """Cache the full pages of a request that still holds them, as soon as their bytes are written
        (positions below ``valid_tokens``, every layer's): a request with the same prefix admitted meanwhile
        shares them read-only instead of computing (or receiving) them again. The holder never writes them
        again; its release later finds them cached. Returns the pages newly cached (0 without a cache)."""
        if self.prefix_cache is None or valid_tokens < PAGE_SIZE:
            return 0
        return self.prefix_cache.insert(token_ids, pages, valid_tokens // PAGE_SIZE)

    # -- what the scheduler asks (`workers.page_tables.GroupPagePools` answers the same for grouped caches) --

    def capacity_error(self, num_tokens: int) -> str | None:
        """Why a request holding ``num_tokens`` positions can never fit this pool, or None."""
        need = pages_for_tokens(num_tokens)
        return None if need <= self.num_pages else f"{need} pages of {PAGE_SIZE} tokens; the pool has {self.num_pages}"

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a request's ``table`` to the pages of ``num_tokens`` positions; False (nothing taken) when
        too few are free."""
        need = pages_for_tokens(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.free_count:
            return False
        table.extend(self.allocate(need))
        return True

    def acquire_tokens(self, token_ids: Sequence[int], hold_tokens: int, reuse: bool = True) -> tuple[list[int], int]:
        """`acquire` the pages of ``hold_tokens`` positions."""
        return self.acquire(token_ids, pages_for_tokens(hold_tokens), reuse)

    # -- the transfer's view (the same calls as `workers.page_tables.GroupPagePools`) --

    pushes_by_chunk = True
    """A prompt's pages are final chunk by chunk: prefill pushes each chunk's finished pages."""

    @staticmethod
    def transfer_plan(table: list[int], num_tokens: int, skip_pages: int) -> tuple[list[int], int]:
        """What moves of a prompt of ``num_tokens`` tokens held in ``table`` when the receiving side already
        holds its first ``skip_pages`` pages: ``(page ids, prompt length as the transfer counts it)``."""
        return list(table[skip_pages:]), num_tokens - skip_pages * PAGE_SIZE

    def free_cached(self, pages: list[int], cached: int) -> None:
        """Drop a request's references to the ``cached`` leading pages it shares from the prefix cache (what
        `transfer_plan` leaves out: the rest are a receive's to give back)."""
        self.free(pages[:cached])

    def reserve_warmup(self) -> int:
        """A transfer id no request ever uses, for prefill replicas' warm-up WRITE of a new pair (held forever)."""
        return self.allocate(1)[0]

    def free_transfer_ids(self, ids: Sequence[int]) -> None:
        """Free pages a receive that ended without its KV held (`transfer_plan`'s ids)."""
        self.free(list(ids))

    def share(self, pages: Sequence[int]) -> None:
        """One more reference to each of ``pages``, cached pages found by `PrefixCache.match` (held or
        parked ones come back into use)."""
        for p in pages:
            if p in self._refs:
                self._refs[p] += 1
            elif p in self._held:
                del self._held[p]  # cached: only read by its new holder, so its step need not be awaited
                self._refs[p] = 1
            elif self.prefix_cache is not None and self.prefix_cache.is_parked(p):
                self.prefix_cache.unpark(p)
                self._refs[p] = 1
            else:
                raise ValueError(f"page {p} is free: only cached pages are shared")

    def free(self, pages: list[int], token_ids: Sequence[int] | None = None, valid_tokens: int = 0) -> None:
        """Drop one reference to each of ``pages`` (a request's, in order); a page nobody references returns
        to the pool, or, if cached, is parked for reuse. With ``token_ids`` (and a prefix cache), the full
        pages whose positions are all below ``valid_tokens`` (their bytes written, every layer's) are cached
        first. While frees are held (`hold_frees`), unreferenced pages wait for their step."""
        # Validate everything first: a bad list must not leave the pool half-updated.
        seen: set[int] = set()
        for p in pages:
            if p not in self._refs or p in seen:
                raise ValueError(f"page {p} freed twice or never allocated")
            seen.add(p)
        if token_ids is not None and self.prefix_cache is not None and valid_tokens >= PAGE_SIZE:
            self.prefix_cache.insert(token_ids, pages, valid_tokens // PAGE_SIZE)
        unused = []
        for p in pages:
            self._refs[p] -= 1
            if not self._refs[p]:
                del self._refs[p]
                unused.append(p)
        if self._hold_tag is not None:
            for p in unused:
                self._held[p] = self._hold_tag
            return
        self._unused(unused)

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
        done = [p for p, tag in self._held.items() if through is None or tag <= through]
        for p in done:
            del self._held[p]
        self._unused(done)

    def refs(self, page: int) -> int:
        """References to ``page`` (0: free, parked or held back)."""
        return self._refs.get(page, 0)

    @property
    def held_count(self) -> int:
        """Pages freed but held back for a step still in flight (neither used nor free)."""
        return len(self._held)

    def _unused(self, pages: list[int]) -> None:
        """Pages no request references: cached ones are parked (in order: the last is evicted first), the
        others go back to the runs."""
        cache = self.prefix_cache
        if cache is None:
            self._give_back_all(pages)
            return
        cache.park([p for p in pages if cache.holds(p)])
        self._give_back_all([p for p in pages if not cache.holds(p)])

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
