"""Prefix caching end to end on the reference backend: cached == uncached token for token (monolithic and
PD, MTP on and off, batched with unrelated prompts), a pool for two requests shared by twenty, and aborts
while holding cached pages."""

from __future__ import annotations

import pytest

from tests.workers.mtp_friendly import make_mtp_friendly
from tests.workers.pd_aborts import abort_at_every_phase
from tests.workers.prompts import random_prompt
from workers.offline import LLM

PREFIX = random_prompt(200, 300, 1)
WARM = PREFIX + random_prompt(10, 300, 2)  # caches the prefix's 3 full pages
BATCH = [
    PREFIX[:65] + random_prompt(10, 300, 3),   # hits 1 page (its key covers the token after it)
    PREFIX + random_prompt(5, 300, 4),         # hits 3 pages
    PREFIX[:129],                              # the whole prompt but its last token: 2 pages
    PREFIX[:128],                              # 2 full pages, but the last token is computed: 1 page
    random_prompt(70, 300, 5),                 # unrelated
    PREFIX[:128] + [PREFIX[128] % 299 + 1] + random_prompt(9, 300, 6),  # another token after page 1: with MTP
]                                              # page 1's key covers it (1 page), without MTP not (2 pages)


def hit_tokens(k: int) -> int:
    return (1 + 3 + 2 + 1 + (1 if k else 2)) * 64
NEW = 4


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    return request.param, make_mtp_friendly(request.param, tmp_path_factory.mktemp(f"pc-{request.param}"))


@pytest.fixture(scope="module")
def uncached(tiny):
    return LLM(tiny[1], prefix_caching=False, chunk_size=256)


@pytest.fixture(scope="module")
def reference(uncached):
    """Uncached monolithic outputs of WARM and BATCH (greedy: MTP and PD must give the same)."""
    out = uncached.generate([WARM] + BATCH, max_new_tokens=NEW, ignore_eos=True)
    return out[0], out[1:]


# Both architectures run monolithic and PD, each with MTP on in one of the two.
CASES = {"deepseek_v32": [(False, 0), (True, 2)], "glm_moe_dsa": [(True, 0), (False, 2)]}


@pytest.fixture(scope="module")
def cached(tiny):
    """The cached LLMs of the architecture's cases, built once (the abort test reuses case 0's)."""
    made = {}

    def get(case: int) -> LLM:
        if case not in made:
            pd, k = CASES[tiny[0]][case]
            made[case] = LLM(tiny[1], pd=pd, mtp_draft_tokens=k, chunk_size=32)
        return made[case]
    return get


@pytest.mark.parametrize("case", [0, 1])
def test_cached_equals_uncached(tiny, reference, cached, case):
    pd, k = CASES[tiny[0]][case]
    llm = cached(case)
    warm, want = reference
    assert llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True) == [warm]
    if pd:
        pushed = llm.pd.prefill.pusher.stats.nbytes
    assert llm.generate(BATCH, max_new_tokens=NEW, ignore_eos=True) == want
    st = llm.stats()
    assert st["prefix_cache_hits"] == hit_tokens(k)  # decode's pool (monolithic: the only one)
    assert st["prefix_cache_queries"] == sum(map(len, [WARM] + BATCH))
    assert st["pool_free_pages"] == st["pool_total_pages"] and st["cached_pages"] > 0
    if pd:
        assert st["prefill_prefix_cache_hits"] == hit_tokens(k)
        assert st["prefill_pool_free_pages"] == st["pool_total_pages"]
        # Decode held the cached pages: prefill pushed only the others.
        page_bytes = llm.pd.prefill.runner.cache.spec.page_bytes()
        pages = sum(-(-len(p) // 64) for p in BATCH) - hit_tokens(k) // 64
        assert llm.pd.prefill.pusher.stats.nbytes - pushed == pages * page_bytes
    if k:
        assert 0 < st["mtp_accepted"] < st["mtp_drafted"]


def test_twenty_requests_sharing_prefixes_in_a_pool_for_two(tiny, uncached):
    if tiny[0] != "deepseek_v32":
        pytest.skip("one architecture is enough for the pool's bookkeeping")
    prefixes = [random_prompt(66, 300, 10 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + random_prompt(1 + 7 * i % 30, 300, 20 + i) for i in range(20)]
    want = uncached.generate(prompts, max_new_tokens=2, ignore_eos=True)
    llm = LLM(tiny[1], num_pages=4, chunk_size=64)  # a request holds 2 pages
    got = []
    for part in (prompts[:10], prompts[10:]):  # each part queued behind two running requests at a time
        got += llm.generate(part, max_new_tokens=2, ignore_eos=True)
    assert got == want
    st = llm.stats()
    assert st["prefix_cache_hits"] > 0 and st["prefix_cache_evictions"] > 0
    assert st["pool_free_pages"] == st["pool_total_pages"] == 4


def test_aborts_holding_cached_pages_leave_nothing_behind(tiny, reference, cached):
    """After test_cached_equals_uncached (same LLM, caches warm): PREFIX's first 2 pages are cached."""
    prefix = PREFIX[:129]  # 2 pages and the token their keys look ahead to
    llm = cached(0)
    llm.generate([WARM], max_new_tokens=NEW, ignore_eos=True)
    if llm.pd is None:  # monolithic: abort while waiting, prefilling and decoding
        from workers.request import Request
        from workers.sample.params import SamplingParams

        eng = llm.engine
        params = SamplingParams(max_new_tokens=20, ignore_eos=True)
        for phase, steps in (("waiting", 0), ("prefilling", 1), ("running", 4)):
            r = Request(phase, prefix + random_prompt(60, 300, 7), params)
            eng.add_request(r)
            for _ in range(steps):
                eng.step()
            if steps:  # its first chunk started after the 2 cached pages, which it holds
                assert r.num_computed > 128 and len(r.page_table) > 2
            assert eng.abort(phase)
            eng.flush()
            assert llm.pool.free_count == llm.pool.num_pages, phase
    else:  # PD: queued, mid-prefill, mid-transfer and mid-decode on both pools
        before = llm.stats()
        abort_at_every_phase(llm.pd.prefill, llm.pd.decode, prefix)
        st = llm.stats()
        assert st["prefix_cache_hits"] > before["prefix_cache_hits"]
        assert st["prefill_prefix_cache_hits"] > before["prefill_prefix_cache_hits"]
    # The cached pages are intact: what follows still equals the uncached run.
    assert llm.generate(BATCH, max_new_tokens=NEW, ignore_eos=True) == reference[1]
