"""A prefix computed once when prompts sharing it arrive together: a prompt's pages are cached as soon as
they are written (`Scheduler.publish`, `PrefillWorker` per chunk), and a waiting prompt whose leading pages
another prompt is computing right now waits for them (`workers.prefix_cache.waits_for_computing`). Outputs equal the
uncached engine's token for token; nothing is left referenced."""

from __future__ import annotations

import time

import pytest

from tests.workers.mtp_friendly import make_mtp_friendly
from tests.workers.prompts import random_prompt
from workers.offline import LLM
from workers.prefill_worker import PrefillTask
from workers.request import Request
from workers.sample.params import SamplingParams

PREFIX = random_prompt(200, 300, 31)  # 3 full pages and 8 tokens
PROMPTS = [PREFIX + random_prompt(10 + i, 300, 40 + i) for i in range(4)] + [random_prompt(90, 300, 50)]
NEW = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_mtp_friendly("deepseek_v32", tmp_path_factory.mktemp("inflight"))


@pytest.fixture(scope="module")
def want(model):
    return LLM(model, prefix_caching=False, chunk_size=512).generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("k", [0, 2])
def test_prompts_arriving_together_compute_their_prefix_once(model, want, k):
    """All five fit one step's budget: without the wait each would compute the shared 3 pages. With MTP
    (k=2) a prompt's pages are cached when its prefill ends (their MTP entries need the next token)."""
    llm = LLM(model, chunk_size=512, mtp_draft_tokens=k)
    assert llm.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == want
    st = llm.stats()
    shared_pages = 3  # each of the three followers reuses the prefix's 3 full pages
    assert st["prefix_cache_hits"] == 3 * shared_pages * 64
    assert st["prefill_tokens"] == sum(map(len, PROMPTS)) - 3 * shared_pages * 64
    assert st["pool_free_pages"] == st["pool_total_pages"]


def test_followers_wait_only_for_pages_being_computed(model):
    """A follower waits while its prefix is computed, and a prompt behind it that shares nothing is admitted
    in the same step (no head-of-line blocking); the follower joins once the pages are cached."""
    llm = LLM(model, chunk_size=512)
    eng = llm.engine
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    leader, follower, other = (Request(n, p, params) for n, p in
                               (("leader", PROMPTS[0]), ("follower", PROMPTS[1]), ("other", PROMPTS[4])))
    for r in (leader, follower, other):
        eng.add_request(r)
    eng.step()  # the leader's whole prompt and the unrelated one; the follower waits for the leader's pages
    assert leader.num_computed == len(PROMPTS[0]) and other.num_computed == len(PROMPTS[4])
    assert list(eng.scheduler.waiting) == [follower]
    eng.step()  # the leader's pages are cached: the follower computes only its suffix
    assert follower.num_computed == len(PROMPTS[1]) and eng.scheduler.pool.prefix_cache.counters.hits == 192
    while eng.has_work:
        eng.step()
    assert all(r.finished for r in (leader, follower, other))
    assert llm.pool.free_count == llm.pool.num_pages


def test_an_aborted_leader_releases_its_followers(model, want):
    """The leader computing the prefix is aborted mid-prefill: the follower stops waiting, computes what is
    not cached (the leader's published pages stay cached and valid) and its output is unchanged."""
    llm = LLM(model, chunk_size=64)
    eng = llm.engine
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    leader, follower = Request("leader", PROMPTS[0], params), Request("follower", PROMPTS[1], params)
    eng.add_request(leader)
    eng.add_request(follower)
    eng.step()
    eng.step()
    assert follower in eng.scheduler.waiting and 0 < leader.num_computed < 192
    assert eng.abort("leader")
    while eng.has_work:
        eng.step()
    assert follower.output == want[1]
    assert eng.scheduler.pool.prefix_cache.counters.hits == 128  # the two pages the leader had written
    assert llm.pool.free_count == llm.pool.num_pages


def test_pd_prefill_publishes_each_chunk(model, want):
    """PD: a prompt submitted to prefill while another with its prefix is mid-prefill reuses the pages
    already computed (the prefill pool caches each chunk's pages at once); outputs unchanged."""
    llm = LLM(model, pd=True, chunk_size=64)
    pre, dec = llm.pd.prefill, llm.pd.decode
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)

    def start(rid, prompt):
        r = Request(rid, prompt, params)
        pages = dec.reserve(r, pre.link.agent.name)
        pre.submit(PrefillTask(rid, r.prompt, params, dec.link.agent.name, pages, r.cached_pages))
        return r

    def pump():
        for res in pre.step():
            dec.on_prefill_result(res)
        dec.step()

    first = start("first", PROMPTS[0])
    pump()
    pump()  # two chunks: pages 0 and 1 written, cached in the prefill pool
    hits = pre.pool.prefix_cache.counters.hits
    second = start("second", PROMPTS[1])
    assert pre.pool.prefix_cache.counters.hits - hits == 128
    for _ in range(2000):
        pump()
        if first.finished and second.finished:
            break
        time.sleep(0.002)
    assert [first.output, second.output] == want[:2]
    for _ in range(500):
        if not dec.has_work and not pre.pusher.has_work():
            break
        pump()
        time.sleep(0.002)
    assert pre.pool.free_count == pre.pool.num_pages and dec.pool.free_count == dec.pool.num_pages


def test_pd_prompts_arriving_together_prefill_and_push_their_prefix_once(model, want):
    """PD: prompts arriving together wait (decode: `DecodeWorker.waits_for_prefix`, prefill:
    `PrefillWorker.waits_for_prefix`) while another's prefix is computed and pushed, then reuse its pages on
    both sides; the unrelated prompt is not held up."""
    llm = LLM(model, pd=True, chunk_size=512)
    assert llm.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == want
    st = llm.stats()
    assert st["prefill_prefix_cache_hits"] == 3 * 3 * 64
    # Decode waited for the leader's KV (`DecodeWorker.waits_for_prefix`): each follower held the prefix's 3
    # pages itself and received only its last page.
    assert st["prefix_cache_hits"] == 3 * 3 * 64
    pushed_pages = sum(-(-len(p) // 64) for p in PROMPTS) - 3 * 3
    assert llm.pd.prefill.pusher.stats.nbytes == pushed_pages * llm.pd.prefill.runner.cache.spec.page_bytes()
    assert st["prefill_pool_free_pages"] == st["pool_total_pages"] and st["pool_free_pages"] == st["pool_total_pages"]


def test_prefill_thread_admits_past_a_waiting_task(model):
    """The served prefill loop (`deployments.prefill_thread.PrefillThread`, driven here without its thread)
    submits the tasks queued behind one that waits for a prefix being computed, and that one once its pages
    are cached: it reuses them."""
    from deployments.prefill_thread import PrefillThread
    from workers.prefill_worker import PrefillTask

    llm = LLM(model, pd=True, chunk_size=64)
    pre, dec = llm.pd.prefill, llm.pd.decode
    loop = PrefillThread(pre, warm_up=False)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def task(rid, prompt):
        r = Request(rid, prompt, params)
        pages = dec.reserve(r, pre.link.agent.name)
        return PrefillTask(rid, r.prompt, params, dec.link.agent.name, pages, r.cached_pages)

    for t in (task("a", PROMPTS[0]), task("b", PROMPTS[1]), task("c", PROMPTS[4])):
        loop.submit(t, None)
    assert set(pre.active) == {"a", "c"} and [t.request_id for t in loop.pending] == ["b"]
    hits = pre.pool.prefix_cache.counters.hits
    for _ in range(3):  # the leader's first 192 tokens: pages 0-2 cached
        loop.tick()
        loop._admit()
    assert "b" in pre.active and not loop.pending
    assert pre.pool.prefix_cache.counters.hits - hits == 3 * 64
    for rid in ("a", "b", "c"):
        dec.abort(rid)
        loop.abort(rid)
    for _ in range(500):
        loop.tick()
        dec.step()
        if not dec.has_work and not loop.has_work():
            break
        time.sleep(0.002)
    assert pre.pool.free_count == pre.pool.num_pages and dec.pool.free_count == dec.pool.num_pages


def test_decode_thread_reserves_past_a_waiting_request(model):
    """The served decode loop (`deployments.decode_thread.DecodeThread`, driven without its thread) reserves the
    requests queued behind one whose prefix's KV is arriving for another, and that one once the KV is in: it
    holds the prefix's pages itself and expects only the rest."""
    from deployments.decode_thread import DecodeThread
    from workers.prefill_worker import PrefillTask

    llm = LLM(model, pd=True, chunk_size=512)
    pre, dec = llm.pd.prefill, llm.pd.decode
    loop = DecodeThread(dec)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    reqs = {rid: Request(rid, p, params) for rid, p in (("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", PROMPTS[4]))}
    for r in reqs.values():
        loop.reserve(r)
    assert set(dec.awaiting) == {"a", "c"} and [r.request_id for r in loop.pending] == ["b"]
    a = reqs["a"]
    ids, _ = dec.pool.transfer_plan(a.page_table, len(a.prompt), a.cached_pages)
    pre.submit(PrefillTask("a", a.prompt, params, dec.link.agent.name, ids, a.cached_pages))
    for _ in range(2000):
        for res in pre.step():
            dec.on_prefill_result(res)
        dec.step()
        if "a" not in dec.awaiting:
            break
        time.sleep(0.002)
    assert a.output  # admitted: its pages are cached at decode
    loop._admit()
    b = reqs["b"]
    assert not loop.pending and "b" in dec.awaiting and b.cached_pages == 3
    for rid in ("a", "b", "c"):
        loop.abort(rid)
        pre.abort(rid)
    for _ in range(500):
        for res in pre.step():
            dec.on_prefill_result(res)
        dec.step()
        if not dec.has_work and not pre.pusher.has_work():
            break
        time.sleep(0.002)
    assert dec.pool.free_count == dec.pool.num_pages - 1  # the warm-up page DecodeThread keeps
