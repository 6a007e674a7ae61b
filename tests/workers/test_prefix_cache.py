"""The prefix cache (workers/prefix_cache.py) and the page pool's reference counts around it: keys, full
comparison under forced collisions, LRU eviction of unreferenced pages only, held frees, no leak."""

from __future__ import annotations

import random

import pytest

from workers.page_pool import PagePool, PoolExhausted
from workers.prefix_cache import LOOKAHEAD, PrefixCache, cacheable_pages, chain_keys, key_lookahead


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 300) for _ in range(n)]


def _pool(num_pages: int, **cache_kw) -> PagePool:
    return PagePool(num_pages, PrefixCache(b"salt", **cache_kw))


def _run(pool: PagePool, tokens: list[int], pages_needed: int | None = None) -> tuple[list[int], int]:
    """A request's life on the pool: take pages for ``tokens``, then release them with every position written."""
    pages, cached = pool.acquire(tokens, pages_needed or -(-len(tokens) // 64))
    pool.free(pages, tokens, len(tokens) - 1)
    return pages, cached


def test_keys_chain_over_every_token_before_and_one_after():
    a = _tokens(200, 1)
    assert cacheable_pages(64) == 0 and cacheable_pages(65) == 1 and cacheable_pages(200) == 3
    k = chain_keys(a, b"s")
    assert len(k) == 3 and len(set(k)) == 3
    b = list(a)
    b[64] += 1  # the first token after page 0: page 0's MTP entry depends on it
    assert chain_keys(b, b"s")[0] != k[0]
    c = list(a)
    c[10] += 1  # inside page 0: every later key changes too
    assert all(x != y for x, y in zip(chain_keys(c, b"s"), k))
    assert chain_keys(a, b"other")[0] != k[0]  # the salt (model, formats) is the chain's root
    assert chain_keys(a[:129], b"s") == k[:2]


def test_without_mtp_pages_a_key_covers_its_own_tokens_only():
    """`key_lookahead(False)`: no MTP layer pages, so a page's bytes depend on its tokens and those before."""
    a = _tokens(200, 1)
    assert key_lookahead(True) == LOOKAHEAD == 1 and key_lookahead(False) == 0
    assert cacheable_pages(64, 0) == 1 and cacheable_pages(200, 0) == 3
    k = chain_keys(a, b"s", lookahead=0)
    b = list(a)
    b[64] += 1  # the token after page 0: page 0's key stays
    assert chain_keys(b, b"s", lookahead=0)[0] == k[0] and chain_keys(b, b"s")[0] != chain_keys(a, b"s")[0]
    assert chain_keys(a, b"s", lookahead=0) != chain_keys(a, b"s")  # the same salt: never mixed up
    cache = PrefixCache(b"s", lookahead=0)
    pages = list(range(10, 13))
    assert cache.insert(a[:192], pages, 3) == 3  # a page needs no token after it
    assert cache.match(a[:128] + [7], 2) == pages[:2]


def test_hits_are_shared_and_the_last_token_is_always_computed():
    pool = _pool(16)
    a = _tokens(192, 2)
    _, cached = _run(pool, a)
    assert cached == 0 and pool.cached_count == 2  # page 2 lacks its lookahead token
    assert pool.free_count == 16  # parked pages count as free
    # The whole prompt but its last token: 2 pages (128 tokens) of a 129-token prompt.
    p1, c1 = pool.acquire(a[:129], 3)
    assert c1 == 2
    # Exactly 2 pages of prompt: the last token must be computed, so only page 0 is reused.
    p2, c2 = pool.acquire(a[:128], 2)
    assert c2 == 1 and p2[0] == p1[0] and p2[1] != p1[1]
    assert pool.prefix_cache.counters.hits == 3 * 64
    assert pool.free_count == 16 - 4  # 2 shared + 1 + 1 fresh
    pool.free(p1)
    pool.free(p2)
    assert pool.free_count == 16


def test_a_forced_collision_never_serves_another_prefix():
    pool = _pool(16, digest=lambda parent, tokens: b"same key")  # every page of every prompt collides
    a, b = _tokens(130, 3), _tokens(130, 4)
    _run(pool, a)
    assert pool.cached_count == 1  # page 0; page 1's key is taken by page 0: not cached
    pages, cached = pool.acquire(b, 3)
    assert cached == 0, "b's first page differs from a's: the key matches, the tokens do not"
    pool.free(pages, b, 129)
    pages, cached = pool.acquire(a[:100], 2)
    assert cached == 1  # a itself still hits
    pool.free(pages)
    assert pool.free_count == 16


def test_eviction_takes_unreferenced_pages_least_recently_used_tail_first():
    pool = _pool(8)
    a, b = _tokens(200, 5), _tokens(200, 6)
    _run(pool, a)  # caches 3 pages of a (4 allocated)
    _run(pool, b)  # then 3 of b: 6 cached, all parked
    assert pool.cached_count == 6 and pool.free_count == 8
    cache = pool.prefix_cache
    held, cached = pool.acquire(a[:150], 3)  # a's 2 first pages shared, 1 fresh from the free runs
    assert cached == 2 and cache.counters.evictions == 0
    more = pool.allocate(2)  # 1 free, so 1 evicted: a's tail, parked before any of b's
    assert cache.counters.evictions == 1 and len(cache.match(a, 4)) == 2 and len(cache.match(b, 4)) == 3
    with pytest.raises(PoolExhausted):
        pool.allocate(4)  # b's 3 parked pages, never the 2 a request holds
    more += pool.allocate(2)  # b's tail first: its head stays reachable
    assert len(cache.match(b, 4)) == 1 and cache.match(a, 4) == held[:2]
    pool.free(more)
    pool.free(held)
    assert pool.free_count == 8


def test_evicting_a_page_forgets_the_pages_after_it():
    pool = _pool(4)
    a = _tokens(200, 7)
    _run(pool, a)
    assert pool.cached_count == 3
    for p in pool.prefix_cache.match(a, 3)[1:]:  # pages 1 and 2 used again: page 0 is now the least recent
        pool.prefix_cache.unpark(p)
        pool.prefix_cache.park([p])
    pool.allocate(2)  # evicts page 0 first: pages 1 and 2 can no longer be reached, so they go with it
    assert pool.cached_count == 0 and pool.prefix_cache.counters.evictions == 3


def test_held_frees_keep_cached_pages_until_their_step_ran():
    pool = _pool(8)
    a = _tokens(130, 8)
    pages, _ = pool.acquire(a, 3)
    pool.hold_frees(7)
    pool.free(pages, a, 129)
    assert pool.held_count == 3 and pool.free_count == 5  # not evictable while the step may touch them
    hit, cached = pool.acquire(a, 3)  # a cached page may be shared at once (only read)
    assert cached == 2 and pool.held_count == 1
    pool.release_held(7)
    pool.hold_frees(None)
    pool.free(hit)
    assert pool.free_count == 8 and pool.held_count == 0


def test_twenty_requests_sharing_prefixes_in_a_pool_for_two():
    """Every request gets its prompt's pages back intact (checked through the cache's own keys) and the
    pool ends whole, however often pages were evicted and reused."""
    pool = _pool(8)  # two requests of 4 pages
    prefixes = [_tokens(150, 10 + i) for i in range(3)]
    rng = random.Random(0)
    live = []
    for i in range(20):
        p = prefixes[i % 3] + _tokens(rng.randrange(1, 90), 100 + i)
        pages, cached = pool.acquire(p, -(-len(p) // 64))
        assert pool.prefix_cache.match(p, cached) == pages[:cached]
        live.append((p, pages))
        if len(live) == 2:
            q, qp = live.pop(0)
            pool.free(qp, q, len(q) - 1)
    for q, qp in live:
        pool.free(qp, q, len(q) - 1)
    c = pool.prefix_cache.counters
    assert c.hits > 0 and c.evictions > 0
    assert pool.free_count == 8 and pool.held_count == 0


def test_bad_frees_and_shares_are_refused_whole():
    pool = _pool(4)
    pages = pool.allocate(2)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([pages[0], pages[0]])
    with pytest.raises(ValueError, match="only cached pages"):
        pool.share([3])
    pool.free(pages)
    assert pool.free_count == 4
