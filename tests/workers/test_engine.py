"""Engine: continuous batching, chunked prefill, preemption, aborts, MTP."""

from __future__ import annotations

import pytest
import torch

from tests.workers.mtp_friendly import make_mtp_friendly
from workers.mtp import check_topk_reuse, draft_slot_layout
from workers.offline import LLM
from workers.request import Request
from workers.sample.params import SamplingParams
from tests.workers.prompts import random_prompt




@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    # MTP drafts that are sometimes right, so acceptance of 0..k drafts all runs.
    return make_mtp_friendly(request.param, tmp_path_factory.mktemp(f"eng-{request.param}"))


# Mixed lengths: 1 token, a page boundary exactly (64, 128), just past one (65),
# and longer than several 32-token chunks (150).
LENGTHS = (1, 64, 65, 128, 150, 9)


@pytest.fixture(scope="module")
def baseline(tiny):
    llm = LLM(tiny, chunk_size=1024)
    prompts = [random_prompt(n, 300, n) for n in LENGTHS]
    return prompts, llm.generate(prompts, max_new_tokens=12, ignore_eos=True)


def test_chunked_prefill_equals_wholerandom_prompt(tiny, baseline):
    prompts, want = baseline
    llm = LLM(tiny, chunk_size=32, max_batch_size=3)
    assert llm.generate(prompts, max_new_tokens=12, ignore_eos=True) == want
    assert llm.stats()["pool_free_pages"] == llm.pool.num_pages


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_mtp_equals_greedy(tiny, baseline, k):
    prompts, want = baseline
    llm = LLM(tiny, mtp_draft_tokens=k, chunk_size=48)
    got = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert got == want
    st = llm.stats()
    assert 0 < st["mtp_accepted"] < st["mtp_drafted"]
    hist = st["mtp_accepted_histogram"]
    # Every acceptance length happened: rejections, partial and full acceptance.
    assert set(hist) == set(range(k + 1)), hist
    assert st["pool_free_pages"] == st["pool_total_pages"]


def test_greedy_mtp_with_topk_reuse(tiny, baseline):
    prompts, want = baseline
    llm = LLM(tiny, mtp_draft_tokens=3, mtp_topk_reuse=True)
    assert llm.generate(prompts, max_new_tokens=12, ignore_eos=True) == want


def test_topk_reuse_refused_for_tree_drafts():
    with pytest.raises(ValueError, match="draft top-k == 1"):
        check_topk_reuse(True, 2)
    check_topk_reuse(False, 4)


def test_draft_slot_layout_is_step_major():
    page_tables = torch.tensor([[3, 7, 0], [5, 2, 9]], dtype=torch.int32)
    first = torch.tensor([62, 10])
    slots = draft_slot_layout(page_tables, first, steps=3)
    assert slots.shape == (3, 2)
    # request 0 crosses from page 3 into page 7 at position 64
    assert slots[:, 0].tolist() == [3 * 64 + 62, 3 * 64 + 63, 7 * 64 + 0]
    assert slots[:, 1].tolist() == [5 * 64 + 10, 5 * 64 + 11, 5 * 64 + 12]
    with pytest.raises(ValueError):
        draft_slot_layout(page_tables, first, steps=2, topk=2)


def test_preemption_under_page_pressure_keeps_outputs(tiny, baseline):
    prompts, want = baseline
    # 8 pages cannot hold all requests at once: the scheduler queues and preempts.
    llm = LLM(tiny, num_pages=8, chunk_size=64)
    got = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert got == want
    assert llm.stats()["pool_free_pages"] == 8


def test_preemption_with_mtp(tiny, baseline):
    prompts, want = baseline
    llm = LLM(tiny, num_pages=8, chunk_size=64, mtp_draft_tokens=2)
    assert llm.generate(prompts, max_new_tokens=12, ignore_eos=True) == want
    assert llm.stats()["pool_free_pages"] == 8


def test_request_that_can_never_fit_is_rejected_clearly(tiny):
    llm = LLM(tiny, num_pages=2)
    with pytest.raises(ValueError, match="pool has 2"):
        llm.generate([random_prompt(200, 300, 1)], max_new_tokens=4)
    assert llm.pool.free_count == 2


@pytest.mark.parametrize("mtp", [0, 2])
def test_sampling_with_seed_is_reproducible(tiny, mtp):
    llm = LLM(tiny, mtp_draft_tokens=mtp)
    prompts = [random_prompt(n, 300, n) for n in (5, 70)]
    a = llm.generate(prompts, max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    b = llm.generate(prompts, max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    c = llm.generate(prompts, max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=8, ignore_eos=True)
    assert a == b
    assert a != c


def test_aborts_at_every_phase_free_everything(tiny):
    llm = LLM(tiny, num_pages=16, chunk_size=32, max_batch_size=2, mtp_draft_tokens=1)
    eng, start = llm.engine, llm.pool.free_count
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    reqs = [Request(f"r{i}", random_prompt(n, 300, i), params) for i, n in enumerate((100, 20, 30, 40))]
    for r in reqs:
        assert eng.add_request(r) is None
    eng.step()  # r0 mid-prefill (100 tokens > chunk 32); r2, r3 queued (batch limit)
    assert reqs[0].state.value == "prefilling" and reqs[3].state.value == "waiting"
    assert eng.abort("r3")            # queued
    assert eng.abort("r0")            # mid-prefill
    for _ in range(3):
        eng.step()
    assert reqs[1].state.value == "running" and reqs[1].output
    assert eng.abort("r1")            # mid-decode
    assert eng.abort("r2")
    assert not eng.abort("r2")        # twice: nothing left to free
    assert not eng.has_work
    assert llm.pool.free_count == start


def test_stop_strings(tiny):
    llm = LLM(tiny)
    p = random_prompt(10, 250, 3)
    free = llm.generate([p], max_new_tokens=12, ignore_eos=True)[0]
    text = bytes(t for t in free if t < 256).decode("latin-1")
    target = text[3:5] if len(text) >= 5 else None
    if target is None:
        pytest.skip("greedy output of this tiny model has too few byte tokens")
    out = llm.generate([p], max_new_tokens=12, ignore_eos=True, stop=(target,))[0]
    assert len(out) < len(free) and out == free[: len(out)]


PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)


def test_greedy_mtp_with_penalties_equals_greedy_with_penalties(tiny, baseline):
    """Verify positions count the drafts before them as generated: greedy MTP stays exact."""
    prompts, plain = baseline[0][:3], baseline[1][:3]
    want = LLM(tiny).generate(prompts, max_new_tokens=12, ignore_eos=True, **PENALTIES)
    assert want != plain  # the penalties changed something
    llm = LLM(tiny, mtp_draft_tokens=2)
    assert llm.generate(prompts, max_new_tokens=12, ignore_eos=True, **PENALTIES) == want
    assert llm.stats()["mtp_accepted"] > 0


def test_seeded_request_samples_the_same_alone_or_batched(tiny):
    """With MTP: drafts and acceptance draw from the request's own stream too (the plain
    sampler's batch invariance is tests/workers/test_sample.py's)."""
    llm = LLM(tiny, mtp_draft_tokens=2)
    prompts = [random_prompt(n, 300, n) for n in (5, 70, 12)]
    kw = dict(max_new_tokens=8, temperature=0.9, top_p=0.9, min_p=0.01, ignore_eos=True, **PENALTIES)
    together = llm.generate(prompts, seed=40, **kw)
    # request i of a call is seeded seed + i
    assert [llm.generate([p], seed=40 + i, **kw)[0] for i, p in enumerate(prompts)] == together


def test_one_read_back_per_step_and_top_logprobs(tiny, monkeypatch):
    import workers.engine as engine_mod

    calls = []
    real = engine_mod.read_back
    monkeypatch.setattr(engine_mod, "read_back", lambda *t: calls.append(len(t)) or real(*t))
    # The read-back of the step itself (overlap scheduling reads each step back during
    # the next one: tests/workers/test_overlap.py).
    llm = LLM(tiny, chunk_size=32, max_batch_size=4, overlap_scheduling=False)
    eng = llm.engine
    reqs = [Request(f"t{i}", random_prompt(n, 300, i), SamplingParams(max_new_tokens=5, ignore_eos=True,
                                                                      logprobs=3 if i else None))
            for i, n in enumerate((3, 40, 20))]
    for r in reqs:
        eng.add_request(r)
    outs = []
    while eng.has_work:
        outs += eng.step()
    # Prefill samples and decode samples of one step come back together.
    assert len(calls) == eng.stats.steps and max(calls) == 2
    lp = {r.request_id: [] for r in reqs}
    for o in outs:
        if o.top_logprobs is not None:
            assert len(o.top_logprobs) == len(o.token_ids)
            lp[o.request_id] += list(zip(o.token_ids, o.logprobs, o.top_logprobs))
    assert not lp["t0"] and len(lp["t1"]) == len(lp["t2"]) == 5
    for tok, chosen, top in lp["t1"] + lp["t2"]:
        ids = list(top)
        assert len(ids) == 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert ids[0] == tok and top[tok] == pytest.approx(chosen, abs=1e-5)  # greedy: the top token
