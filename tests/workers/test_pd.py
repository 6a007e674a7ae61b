"""Disaggregated prefill/decode through real NIXL (DRAM) vs monolithic vs transformers."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.workers.mtp_friendly import make_mtp_friendly
from tests.workers.pd_aborts import abort_at_every_phase
from workers.offline import LLM
from tests.workers.prompts import random_prompt

LENGTHS = (1, 64, 65, 128, 150, 9)




@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    return make_mtp_friendly(request.param, tmp_path_factory.mktemp(f"pd-{request.param}"))


@pytest.fixture(scope="module")
def reference(tiny):
    prompts = [random_prompt(n, 300, n) for n in LENGTHS]
    mono = LLM(tiny, chunk_size=1024).generate(prompts, max_new_tokens=10, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hf_out = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return prompts, mono, hf_out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_pd_equals_monolithic_equals_transformers(tiny, reference, kv_cache_dtype):
    prompts, mono, hf_out = reference
    if kv_cache_dtype == "auto":
        assert mono == hf_out
    else:  # fp8 caches: PD must still equal monolithic in the same mode
        mono = LLM(tiny, kv_cache_dtype="fp8").generate(prompts, max_new_tokens=10, ignore_eos=True)
    llm = LLM(tiny, pd=True, chunk_size=32, kv_cache_dtype=kv_cache_dtype)
    assert llm.generate(prompts, max_new_tokens=10, ignore_eos=True) == mono
    st = llm.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"] == st["prefill_pool_free_pages"]


@pytest.mark.parametrize("k", [1, 3])
def test_pd_with_mtp_equals_monolithic(tiny, reference, k):
    prompts, mono, _ = reference
    llm = LLM(tiny, pd=True, chunk_size=48, mtp_draft_tokens=k)
    assert llm.generate(prompts, max_new_tokens=10, ignore_eos=True) == mono
    st = llm.stats()
    assert 0 < st["mtp_accepted"] < st["mtp_drafted"]


def test_pd_seeded_sampling_equals_monolithic(tiny, reference):
    prompts = reference[0][:3]
    kw = dict(max_new_tokens=8, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
              frequency_penalty=0.3, seed=11, ignore_eos=True)
    assert LLM(tiny, pd=True).generate(prompts, **kw) == LLM(tiny).generate(prompts, **kw)


def test_pd_aborts_at_every_phase_free_both_pools(tiny):
    llm = LLM(tiny, pd=True, chunk_size=32, num_pages=32)
    abort_at_every_phase(llm.pd.prefill, llm.pd.decode)


def _serve_to_end(pre, dec, reqs, starts) -> None:
    """Step both sides until every request finished, then until nothing is in flight; both pools
    must be back at their ``starts`` free counts."""
    end = time.monotonic() + 60  # decode's notifications travel on their own
    while not all(r.finished for r in reqs) and time.monotonic() < end:
        for res in pre.step():
            dec.on_prefill_result(res)
        dec.step()
    for _ in range(200):
        if not dec.has_work and not pre.pusher.has_work():
            break
        pre.step()
        dec.step()
    assert (pre.pool.free_count, dec.pool.free_count) == starts


def test_prefill_round_sees_a_lone_prompts_push_end(tiny):
    """Nothing else to compute: the round that finishes the prompt still waits for its WRITE
    (decode's notification goes out on that poll), rather than the engine's next idle poll."""
    from workers.prefill_worker import PrefillTask
    from workers.request import Request
    from workers.sample.params import SamplingParams

    llm = LLM(tiny, pd=True, chunk_size=32, num_pages=32)
    pre, dec = llm.pd.prefill, llm.pd.decode
    p_start, d_start = pre.pool.free_count, dec.pool.free_count
    r = Request("solo", random_prompt(30, 300, 7), SamplingParams(max_new_tokens=3, ignore_eos=True))
    pre.submit(PrefillTask("solo", r.prompt, r.params, dec.link.agent.name, dec.reserve(r, pre.link.agent.name)))
    (res,) = pre.step()
    assert res.request_id == "solo" and res.ok and not pre.pusher.active
    # What the prefill replica's metrics record: the push's status, bytes and tail.
    assert res.push_status == "done" and res.push_nbytes == pre.runner.cache.spec.page_bytes() * 1
    assert 0 < res.push_tail_s < 30
    dec.on_prefill_result(res)
    _serve_to_end(pre, dec, [r], (p_start, d_start))
    assert len(r.output) == 3


def _submit_short_and_long(pre, dec, params) -> dict:
    """Prompts of 20 ("short") and 100 ("long") tokens, reserved at decode and submitted to prefill;
    with ``chunk_size=32`` the first round computes all of "short" and 12 tokens of "long"."""
    from workers.prefill_worker import PrefillTask
    from workers.request import Request

    reqs = {}
    for rid, n in (("short", 20), ("long", 100)):
        r = reqs[rid] = Request(rid, random_prompt(n, 300, n), params)
        pre.submit(PrefillTask(rid, r.prompt, params, dec.link.agent.name, dec.reserve(r, pre.link.agent.name)))
    return reqs


def test_prefill_round_sees_a_finished_push_end_before_the_next_forward(tiny):
    """A prompt finished in a round while another still needs forwards: the round waits for its
    WRITE (decode's notification goes out on that poll), so its result comes from this round,
    not after the next forward; both pools come back whole."""
    from workers.sample.params import SamplingParams

    llm = LLM(tiny, pd=True, chunk_size=32, num_pages=32)
    pre, dec = llm.pd.prefill, llm.pd.decode
    p_start, d_start = pre.pool.free_count, dec.pool.free_count
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    reqs = _submit_short_and_long(pre, dec, params)
    results = pre.step()  # 20 tokens of "short" (its last chunk) and 12 of "long"
    assert [r.request_id for r in results] == ["short"] and results[0].ok
    assert pre.pusher.active == ["long"] and 0 < pre.active["long"].done < 100
    for res in results:
        dec.on_prefill_result(res)
    _serve_to_end(pre, dec, list(reqs.values()), (p_start, d_start))
    assert all(len(r.output) == 4 for r in reqs.values())


def test_a_prompts_last_chunk_is_pushed_unfenced_after_its_first_token_was_read_back(tiny, monkeypatch):
    """A round that read a first token back has waited for every kernel it queued (the MTP layer's
    runs before the sampling), so its pushes need no fence; a round of partial chunks only is fenced.
    (On CPU the link has no fence: a counting one stands in for the CUDA event.)"""
    from workers.sample.params import SamplingParams

    llm = LLM(tiny, pd=True, chunk_size=32, num_pages=32, mtp_draft_tokens=1)
    pre, dec = llm.pd.prefill, llm.pd.decode
    assert pre.mtp and pre.pusher.fence is None
    taken = []  # prompt tokens done per active request, at each fence taken

    def done() -> dict[str, int]:
        return {rid: a.done for rid, a in pre.active.items()}

    pre.pusher.fence = lambda: taken.append(done()) or (lambda: True)
    # What makes the read-back a fence: the MTP layer's forward is queued before any sampling.
    calls = []
    import workers.prefill_worker as prefill_worker

    real_sample, real_mtp = prefill_worker.sample_hidden, pre.runner.model.mtp_forward
    monkeypatch.setattr(prefill_worker, "sample_hidden", lambda *a, **k: calls.append("sample") or real_sample(*a, **k))
    monkeypatch.setattr(pre.runner.model, "mtp_forward",
                        lambda *a, **k: calls.append("mtp") or real_mtp(*a, **k))
    p_start, d_start = pre.pool.free_count, dec.pool.free_count
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    reqs = _submit_short_and_long(pre, dec, params)
    rounds, orders = [], []
    while pre.active:
        calls.clear()
        for res in pre.step():
            dec.on_prefill_result(res)
        rounds.append(len(taken))
        orders.append(list(calls))
    # Round 1: "short" ends (read back) with 12 tokens of "long": no fence. Rounds 2-3: "long" only,
    # partial: 44 tokens finish no 64-token page (nothing to push), 76 finish page 0: fenced.
    # Round 4: "long" ends: no fence.
    assert rounds == [0, 0, 1, 1]
    assert [t["long"] for t in taken] == [76]
    assert orders == [["mtp", "sample"], ["mtp"], ["mtp"], ["mtp", "sample"]]
    _serve_to_end(pre, dec, list(reqs.values()), (p_start, d_start))
    assert all(len(r.output) == 2 for r in reqs.values())
