"""DeepSeek-V4 prefix caching (`workers.v4_prefix`) on the reference backend: cached == uncached token
for token (monolithic and PD, batched with unrelated prompts, each side's hit alone), a cached suffix's
logits equal the whole prompt's, cached pages are never written, a pool for two requests shared by
twenty, aborts in every phase while holding cached pages, hash collisions only miss, and the counters.

The tiny checkpoint (window 8, CSA every 4 tokens, HCA every 8, 256-token pages) cuts every 256
tokens: PREFIX (1,100 tokens) has cuts at 256 / 512 / 768 / 1024, crosses 137 sliding windows, 275 CSA
and 137 HCA blocks; its c4 pages hold 1,024 tokens (the cut at 768 copies a straddling page, 1,024
ends one), its c128 pages 2,048 (every cut copies one).
"""

from __future__ import annotations

import pytest
import torch

from attention.group_cache import UNIT_BYTES
from models.batch import ForwardMode
from tests.workers.pd_aborts import abort_at_every_phase
from tests.workers.prompts import random_prompt
from workers.model_runner import WorkItem
from workers.offline import LLM
from workers.prefix_cache import chain_keys, routing_key
from workers.request import Request
from workers.sample.params import SamplingParams
from workers.v4_prefix import V4PrefixCache, pages_with_cuts, tokens_with_cuts

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = random_prompt(1100, 300, 1)
WARM = PREFIX + random_prompt(10, 300, 2)  # caches the cuts 256, 512, 768 and 1024
BATCH = [
    PREFIX[:257] + random_prompt(10, 300, 3),  # hits the first cut (its key covers the token after it)
    PREFIX + random_prompt(5, 300, 4),  # hits 4 cuts
    PREFIX[:769],  # the whole prompt but its last token: 768
    PREFIX[:768],  # 768 tokens, but the last token is computed: 512
    random_prompt(300, 300, 5),  # unrelated
]
HITS = (256, 1024, 768, 512, 0)
NEW = 4


@pytest.fixture(scope="module")
def reference(tiny_v4):
    """Uncached monolithic outputs of WARM and BATCH."""
    out = LLM(tiny_v4, prefix_caching=False, chunk_size=256, num_pages=32).generate(
        [WARM] + BATCH, max_new_tokens=NEW, ignore_eos=True)
    return out[0], out[1:]


@pytest.fixture(scope="module")
def cached(tiny_v4):
    """A warm cached LLM per mode (the abort test reuses them)."""
    made = {}

    def get(pd: bool) -> LLM:
        if pd not in made:
            # Chunks that end off the cuts (a cut's window is written by a chunk that goes on past it);
            # PD: under 100 tokens, as `abort_at_every_phase` expects.
            made[pd] = LLM(tiny_v4, chunk_size=48 if pd else 100, num_pages=32, pd=pd)
        return made[pd]
    return get


def _held_bytes(pool) -> dict:
    """A copy of every page the prefix cache holds."""
    return {(g, p): pool.cache.view(g)[p].clone() for g, p in pool.prefix_cache.held()}


def _push_bytes(pool, prompts, hits) -> int:
    """Bytes a push of ``prompts`` moves when decode shares ``hits`` tokens of each."""
    total = 0
    for p, c in zip(prompts, hits):
        for g, n in pool.need(len(p)).items():
            shared = len(pool.prefix_cache.shared_indices(pool.groups[g], c)) if c else 0
            total += (n - shared) * pool.cache.layouts[g].units_per_page * UNIT_BYTES
    return total


@pytest.mark.parametrize("pd", [False, True])
def test_cached_equals_uncached(reference, cached, pd):
    llm = cached(pd)
    warm, want = reference
    assert llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True) == [warm]
    pool = llm.pool
    assert pool.prefix_cache.num_cuts == 4 and pool.cached_count > 0
    held = _held_bytes(pool)
    if pd:
        pushed = llm.pd.prefill.pusher.stats.nbytes
    assert llm.generate(BATCH, max_new_tokens=NEW, ignore_eos=True) == want
    st = llm.stats()
    assert st["prefix_cache_hits"] == sum(HITS)  # decode's pool (monolithic: the only one)
    assert st["prefix_cache_queries"] == sum(map(len, [WARM] + BATCH))
    assert st["pool_free_pages"] == st["pool_total_pages"] and st["cached_pages"] == pool.cached_count > 0
    assert st["prefix_cache_evictions"] == 0
    # Nothing cached was written, by a forward or a push: every page held before is held and unchanged.
    for (g, p), before in held.items():
        assert pool.prefix_cache.holds(g, p) and torch.equal(pool.cache.view(g)[p], before), (g, p)
    if pd:
        assert st["prefill_prefix_cache_hits"] == sum(HITS)
        assert st["prefill_pool_free_pages"] == st["pool_total_pages"]
        # Decode held the pages before each cut: prefill pushed only the others.
        assert llm.pd.prefill.pusher.stats.nbytes - pushed == _push_bytes(pool, BATCH, HITS)


def test_pd_with_the_hit_on_one_side_only(tiny_v4, reference):
    """Decode shares a cut prefill computes again, then prefill reuses a cut decode receives whole; first
    decode reuses the cut at a prompt's very end, whose state prefill's last chunk wrote and pushed."""
    warm, want = reference
    llm = LLM(tiny_v4, chunk_size=100, num_pages=32, pd=True)
    pre, dec = llm.pd.prefill.pool, llm.pd.decode.pool
    uncached = LLM(tiny_v4, prefix_caching=False, chunk_size=256)
    ends = PREFIX[:512]
    alone = uncached.generate([ends], max_new_tokens=NEW, ignore_eos=True)
    longer = ends + alone[0] + random_prompt(50, 300, 6)  # the next turn: the cut's key covers token 1
    alone += uncached.generate([longer], max_new_tokens=NEW, ignore_eos=True)
    assert llm.generate([ends], max_new_tokens=NEW, ignore_eos=True) == alone[:1]
    assert dec.prefix_cache.num_cuts == 2 and pre.prefix_cache.num_cuts == 1  # prefill: cuts before the last token
    # Decode's state at the cut 512 came in prefill's push: the state an uncached forward leaves at 512.
    entry = dec.prefix_cache.match(longer, 512)
    assert entry.cut == 512
    table = uncached.pool.allocate_for_tokens(512)
    uncached.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(ends), 0, table.frozen())])
    for g in dec.prefix_cache.cut_groups:  # the ring slots a forward resuming at 512 reads: block [512 - m, 512)
        grp = dec.prefix_cache.by_name[g]
        slots = [p % grp.tokens_per_page for p in range(512 - grp.ratio, 512)]
        torch.testing.assert_close(dec.cache.view(g)[entry.pages[g][2]][:, slots],
                                   uncached.pool.cache.view(g)[table.pages[g][0]][:, slots])
    uncached.pool.free(table)
    pre.clear_prefix_cache()
    assert llm.generate([longer], max_new_tokens=NEW, ignore_eos=True) == alone[1:]
    assert (llm.stats()["prefix_cache_hits"], llm.stats()["prefill_prefix_cache_hits"]) == (512, 0)
    pre.clear_prefix_cache()
    dec.clear_prefix_cache()
    assert llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True) == [warm]
    for cleared in (pre, dec):
        cleared.clear_prefix_cache()
        assert cleared.cached_count == 0 and cleared.free_count == cleared.num_pages
        hits = {k: llm.stats()[k] for k in ("prefix_cache_hits", "prefill_prefix_cache_hits")}
        pushed = llm.pd.prefill.pusher.stats.nbytes
        assert llm.generate(BATCH[:2], max_new_tokens=NEW, ignore_eos=True) == want[:2]
        st = llm.stats()
        decode_hits = st["prefix_cache_hits"] - hits["prefix_cache_hits"]
        prefill_hits = st["prefill_prefix_cache_hits"] - hits["prefill_prefix_cache_hits"]
        assert (prefill_hits, decode_hits) == ((0, 1280) if cleared is pre else (1280, 0))
        assert llm.pd.prefill.pusher.stats.nbytes - pushed == _push_bytes(dec, BATCH[:2],
                                                                        HITS[:2] if cleared is pre else (0, 0))
        assert st["pool_free_pages"] == st["pool_total_pages"] == st["prefill_pool_free_pages"]
        llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True)  # both warm again


def test_cached_suffix_logits_equal_the_whole_prompts(tiny_v4, cached, reference):
    """A suffix computed from a cut's pages gives the logits of the same positions of one uncached
    forward over the whole prompt, within float32 rounding (the copied pages, the cut state)."""
    llm = cached(False)
    llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True)
    for p, cut in ((PREFIX[:800], 768), (PREFIX + [5, 6, 7], 1024), (PREFIX[:300], 256)):
        full = llm.prompt_logits(p)
        table, cached_pages = llm.pool.acquire_tokens(p, len(p))
        assert cached_pages * 64 == cut
        try:
            _, hidden = llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(p[cut:]), cut, table.frozen())])
            with torch.inference_mode():
                torch.testing.assert_close(llm.model.logits(hidden), full[cut:], rtol=1e-5, atol=1e-5)
        finally:
            llm.pool.free(table)
    assert llm.pool.free_count == llm.pool.num_pages


def test_a_hit_shares_the_pages_before_the_cut_and_copies_the_rest(cached, reference):
    llm = cached(False)
    llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True)
    pool, cache = llm.pool, llm.pool.prefix_cache
    p = PREFIX[:800]
    table, n = pool.acquire_tokens(p, len(p) + 2)
    try:
        assert n * 64 == 768
        assert {g: len(ps) for g, ps in table.pages.items()} == pool.need(len(p) + 2)
        shared, copies = cache.hit_pages(cache.match(p, len(p) - 1))
        for g, ps in table.pages.items():
            for i, page in enumerate(ps):
                assert (page == shared[g].get(i)) == (i in shared[g]), (g, i)
                assert cache.holds(g, page) == (i in shared[g]), (g, i)  # fresh pages are no cached ones
        # 768 tokens: swa pages 0-2 shared; c4 entries 192 (page 0 copied), c8 96 (page 0 copied);
        # cut states 1-3 shared, the state at 768 copied into the live page.
        assert {g: sorted(s) for g, s in shared.items()} == {
            "swa": [0, 1, 2], "csa_kv": [], "csa_index": [], "hca_kv": [], "hca_state": [],
            "csa_state": [1, 2, 3], "csa_index_state": [1, 2, 3]}
        assert {g: i for g, (i, _) in copies.items()} == {
            "csa_kv": 0, "csa_index": 0, "hca_kv": 0, "csa_state": 0, "csa_index_state": 0}
        for g, (i, src) in copies.items():
            assert torch.equal(pool.cache.view(g)[table.pages[g][i]], pool.cache.view(g)[src])
    finally:
        pool.free(table)
    assert pool.free_count == pool.num_pages


def test_twenty_requests_sharing_prefixes_in_a_pool_for_two(tiny_v4):
    prefixes = [random_prompt(300, 300, 10 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + random_prompt(1 + 7 * i % 30, 300, 20 + i) for i in range(20)]
    want = LLM(tiny_v4, prefix_caching=False, chunk_size=256).generate(prompts, max_new_tokens=2, ignore_eos=True)
    llm = LLM(tiny_v4, num_pages=4, chunk_size=128)  # a request holds 2 pages of swa and of each CSA state
    got = []
    for part in (prompts[:10], prompts[10:]):  # each part queued behind two running requests at a time
        got += llm.generate(part, max_new_tokens=2, ignore_eos=True)
    assert got == want
    st = llm.stats()
    assert st["prefix_cache_hits"] > 0 and st["prefix_cache_evictions"] > 0
    assert st["pool_free_pages"] == st["pool_total_pages"] == 4 * 7
    assert llm.pool.free_counts() == {g: 4 for g in llm.pool.groups}


def test_aborts_holding_cached_pages_leave_nothing_behind(reference, cached):
    """Every phase, monolithic and PD, with the first cut of PREFIX cached on both sides."""
    prefix = PREFIX[:257]  # the cut and the token its key looks ahead to
    for pd in (False, True):
        llm = cached(pd)
        llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True)
        before = llm.stats()
        if not pd:  # abort while waiting, prefilling and decoding
            eng = llm.engine
            params = SamplingParams(max_new_tokens=20, ignore_eos=True)
            for phase, steps in (("waiting", 0), ("prefilling", 1), ("running", 4)):
                r = Request(phase, prefix + random_prompt(300, 300, 7), params)
                eng.add_request(r)
                for _ in range(steps):
                    eng.step()
                if steps:  # its first chunk started at the cut, whose pages it shares
                    assert r.num_computed > 256 and r.page_table
                    assert any(llm.pool.prefix_cache.holds("swa", p) for p in r.page_table.pages["swa"])
                assert eng.abort(phase)
                eng.flush()
                assert llm.pool.free_count == llm.pool.num_pages, phase
            assert llm.stats()["prefix_cache_hits"] == before["prefix_cache_hits"] + 2 * 256
        else:  # queued, mid-prefill, mid-transfer and mid-decode on both pools
            abort_at_every_phase(llm.pd.prefill, llm.pd.decode, prefix)
            st = llm.stats()
            assert st["prefix_cache_hits"] > before["prefix_cache_hits"]
            assert st["prefill_prefix_cache_hits"] > before["prefill_prefix_cache_hits"]
            for pools in (llm.pd.prefill.pool, llm.pd.decode.pool):
                assert pools.free_counts() == {g: p.num_pages for g, p in pools.pools.items()}
        # The cached pages are intact: what follows still equals the uncached run.
        assert llm.generate(BATCH, max_new_tokens=NEW, ignore_eos=True) == reference[1]


def test_a_hash_collision_only_misses(tiny_v4, reference):
    """Every key collides (a constant digest): a prompt of other tokens finds the key taken and
    computes everything; nothing of the cached prefix is reused for it."""
    warm, want = reference
    llm = LLM(tiny_v4, chunk_size=256, num_pages=32)
    llm.pool.prefix_cache.digest = lambda parent, tokens: b"k" * 32
    assert llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True) == [warm]
    assert llm.pool.prefix_cache.num_cuts == 1  # the chain stops where its own key repeats
    assert llm.generate(BATCH[4:], max_new_tokens=NEW, ignore_eos=True) == want[4:]
    assert llm.generate(BATCH[:1], max_new_tokens=NEW, ignore_eos=True) == want[:1]  # the real hit
    assert llm.stats()["prefix_cache_hits"] == 256


def test_counters_and_routing_keys(cached, reference):
    """The replica's prefix-cache figures (what the metrics and the cache-aware router read) see V4's
    cache: pages held, queries / hits in tokens, and the 64-token page keys of the cached cuts."""
    from deployments.replica_stats import PrefixKeys

    llm = cached(False)
    llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True)
    f = PrefixKeys(llm.pool).fields()
    assert f["cached_pages"] == llm.pool.cached_count > 0
    assert f["prefix_hits"] == llm.pool.prefix_cache.counters.hits and f["prefix_queries"] >= f["prefix_hits"] > 0
    # The prompt's first 16 page keys (4 cuts) are among the reported keys, as a router hashes them.
    keys = [routing_key(k) for k in chain_keys(PREFIX, llm.pool.prefix_cache.salt, 16)]
    assert set(keys) <= set(f["prefix_keys"])


def test_cut_geometry_and_pd_skips(tiny_v4):
    llm = LLM(tiny_v4, num_pages=8)
    pool = llm.pool
    cache: V4PrefixCache = pool.prefix_cache
    assert cache.cut == 256 and cache.cut_groups == ("csa_state", "csa_index_state")
    # A CSA state group holds a page per cut <= n besides the live one; never more than swa's + 1.
    assert [pool.need(n)["csa_state"] for n in (1, 255, 256, 257, 512)] == [1, 1, 2, 2, 3]
    assert [pool.need(n)["swa"] for n in (1, 255, 256, 257, 512)] == [1, 1, 1, 2, 2]
    assert pool.need(600)["hca_state"] == 1
    # The admission bound is the pools' rule inverted: the most tokens `pages` pages hold in a group.
    for g in pool.groups.values():
        for pages in (1, 2, 5):
            n = tokens_with_cuts(g, pages, cache.cut, cache.cut_groups)
            if n is not None:
                assert pages_with_cuts(g, n, cache.cut, cache.cut_groups) <= pages, (g.name, pages)
                assert pages_with_cuts(g, n + 1, cache.cut, cache.cut_groups) > pages, (g.name, pages)
    for bad in (1, 3, 5, 8):  # not a cut, or not before the prompt's last token (512 tokens)
        with pytest.raises(ValueError):
            pool.check_skip(512, bad)
    pool.check_skip(513, 8)
    pool.check_skip(300, 4)
