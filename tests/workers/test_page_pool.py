"""PagePool: contiguous allocation (best-fit run, fewest runs otherwise), exact counts, merging on free."""

from __future__ import annotations

import random

import pytest

from workers.page_pool import PagePool, PoolExhausted


def runs_of(pages: list[int]) -> list[tuple[int, int]]:
    """``pages`` (in their order) as maximal ascending runs ``(start, length)``: one transfer descriptor per run and region."""
    out: list[list[int]] = []
    for p in pages:
        if out and p == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return [(s, k) for s, k in out]


def min_runs(free_runs: list[tuple[int, int]], n: int) -> int:
    """Fewest free runs whose lengths add up to at least ``n``."""
    total, k = 0, 0
    for length in sorted((k for _, k in free_runs), reverse=True):
        if total >= n:
            break
        total += length
        k += 1
    return k


def check_invariants(pool: PagePool, used: set[int]) -> None:
    """Free runs are disjoint, maximal, inside the pool, and cover exactly the pages not in use."""
    runs = pool.free_runs()
    free = [p for s, k in runs for p in range(s, s + k)]
    assert len(free) == len(set(free)) == pool.free_count == pool.num_pages - len(used)
    assert set(free) == set(range(pool.num_pages)) - used
    for (s1, k1), (s2, _) in zip(runs, runs[1:]):
        assert s1 + k1 < s2, f"runs {s1}+{k1} and {s2} touch: not merged"


def make_holes(pool: PagePool, sizes: list[int]) -> None:
    """Fill the pool, then free runs of ``sizes`` pages from page 0 up, each followed by one page kept in use."""
    everything = pool.allocate(pool.num_pages)
    p = 0
    for size in sizes:
        pool.free(everything[p : p + size])
        p += size + 1


def test_fresh_pool_hands_out_ascending_contiguous_runs():
    pool = PagePool(100)
    a, b, c = pool.allocate(10), pool.allocate(1), pool.allocate(30)
    assert a == list(range(10)) and b == [10] and c == list(range(11, 41))
    assert pool.free_count == 59 and pool.free_runs() == [(41, 59)]
    assert pool.allocate(0) == [] and pool.free_count == 59
    assert pool.allocate_for_tokens(65) == [41, 42]  # ceil(65 / 64) pages


def test_best_fit_takes_the_smallest_run_that_holds_the_request():
    pool = PagePool(64)
    make_holes(pool, [5, 3, 10, 5, 2])
    # Holes at 0-4, 6-8, 10-19, 21-25, 27-28 (the rest of the pool is in use).
    assert pool.free_runs() == [(0, 5), (6, 3), (10, 10), (21, 5), (27, 2)]
    assert pool.allocate(4) == [0, 1, 2, 3]  # a 5-run, the lower one; the 10-run stays whole
    assert pool.allocate(3) == [6, 7, 8]  # exact fit
    assert pool.allocate(1) == [4]  # the 1-page leftover, not a longer run
    assert pool.allocate(6) == list(range(10, 16))
    assert pool.allocate(2) == [27, 28]
    assert pool.free_runs() == [(16, 4), (21, 5)] and pool.free_count == 9


def test_without_a_long_enough_run_it_takes_the_fewest_runs():
    pool = PagePool(64)
    make_holes(pool, [2, 6, 1, 4, 6, 3])
    free = pool.free_runs()
    assert [k for _, k in free] == [2, 6, 1, 4, 6, 3]
    pages = pool.allocate(13)
    # 6 + 6 + one run holding the last 1: the 1-page run, not a piece of a longer one.
    assert len(runs_of(pages)) == min_runs(free, 13) == 3
    assert pages == sorted(pages) and len(set(pages)) == 13
    assert sorted(k for _, k in pool.free_runs()) == [2, 3, 4]  # the short runs it did not need stay whole


def test_free_merges_neighbours_back_into_one_run_in_any_order():
    pool = PagePool(50)
    parts = [pool.allocate(k) for k in (7, 1, 12, 3, 27)]
    rng = random.Random(0)
    rng.shuffle(parts)
    for part in parts:
        part = list(part)
        rng.shuffle(part)
        pool.free(part)
    assert pool.free_runs() == [(0, 50)] and pool.free_count == 50


def test_bad_frees_raise_and_change_nothing():
    pool = PagePool(8)
    a = pool.allocate(3)
    with pytest.raises(ValueError, match="freed twice or never allocated"):
        pool.free([a[0], 5])  # 5 was never allocated; a[0] must not be freed either
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a[1], a[1]])
    assert pool.free_count == 5 and pool.free_runs() == [(3, 5)]
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free(a)
    with pytest.raises(PoolExhausted, match="asked for 9 pages, 8 of 8 free"):
        pool.allocate(9)
    assert pool.free_count == 8


class LifoFreeList:
    """The allocator PagePool replaced: a LIFO free list of single pages (for comparison)."""

    def __init__(self, n: int):
        self._free = list(range(n - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(sorted(pages, reverse=True))

    @property
    def free_count(self) -> int:
        return len(self._free)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_churn_keeps_requests_contiguous_whenever_the_pool_allows(seed):
    """Serving-like churn: requests of mixed sizes arrive and finish in random order.

    Every allocation must be one run whenever some free run holds it, and the
    fewest runs otherwise; the counts stay exact throughout. The old LIFO
    free list, under the same churn, splits far more requests.
    """
    rng = random.Random(seed)
    num_pages = 2048
    pool, lifo = PagePool(num_pages), LifoFreeList(num_pages)
    live: list[tuple[list[int], list[int]]] = []
    used: set[int] = set()
    runs_new = runs_old = requests = 0
    for step in range(3000):
        # Sizes of 8k/32k-like prompts mixed with short ones and one-page decode growth.
        n = rng.choice([1, 1, 2, 5, 16, 40, 128, 512])
        while live and (pool.free_count < n or rng.random() < 0.45):
            new, old = live.pop(rng.randrange(len(live)))
            pool.free(new)
            lifo.free(old)
            used -= set(new)
        if pool.free_count < n:
            continue
        free = pool.free_runs()
        longest = max(k for _, k in free)
        pages = pool.allocate(n)
        got = len(runs_of(pages))
        assert got == (1 if longest >= n else min_runs(free, n)), (step, n, free)
        assert not used & set(pages)
        used |= set(pages)
        old = lifo.allocate(n)
        live.append((pages, old))
        if n > 1:
            requests += 1
            runs_new += got
            runs_old += len(runs_of(old))
        if step % 250 == 0:
            check_invariants(pool, used)
    check_invariants(pool, used)
    for new, old in live:
        pool.free(new)
        lifo.free(old)
    assert pool.free_runs() == [(0, num_pages)] and pool.free_count == lifo.free_count == num_pages
    # Descriptors per multi-page request (per region): fewer than half of the free list's.
    assert runs_new / requests < 0.5 * runs_old / requests, (runs_new / requests, runs_old / requests)
    print(f"seed {seed}: runs per multi-page request {runs_new / requests:.2f} (PagePool) vs "
          f"{runs_old / requests:.2f} (LIFO free list)")
