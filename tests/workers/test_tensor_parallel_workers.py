"""Tensor-parallel replicas through the offline API: rank workers in real Ray
actors (gloo), driven by one engine; PD pushes rank i -> rank i over real NIXL.

Greedy output with tp_size 2 equals tp_size 1, monolithic and PD, and every
page pool (the driver's, and with PD both sides') returns to its start count.
"""

from __future__ import annotations

import os
import time

import pytest
import ray

from tests.workers.mtp_friendly import make_mtp_friendly
from tests.workers.prompts import random_prompt
from workers.group_link import group_agent_name, rank_agent_name
from workers.offline import LLM
from workers.prefill_worker import PrefillTask
from workers.request import Request
from workers.sampler import SamplingParams

# Chunks of 32 split the 70- and 100-token prompts: prefill pushes several chunks per rank.
PROMPTS = [random_prompt(n, 300, 200 + n) for n in (70, 5, 100, 64)]
NEW = 8


@pytest.fixture(scope="module")
def ray_session():
    # Loopback only for UCX (the rank actors' NIXL agents inherit the driver's environment).
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"UCX_NET_DEVICES": "lo", "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_agent_names_map_rank_to_rank():
    assert rank_agent_name("decode-abc@123", 1) == "decode-abc.r1@123"
    assert group_agent_name("decode-abc.r1@123") == "decode-abc@123"
    with pytest.raises(ValueError):
        group_agent_name("decode-abc@123")


# One arch without MTP, the other with one draft token (the MTP layer is sharded too,
# and its cache pages travel with the others).
@pytest.mark.slow  # ~45 s on 2 cores: four rank actors start per case
@pytest.mark.parametrize("arch,mtp", [("deepseek_v32", 0), ("glm_moe_dsa", 1)])
def test_tp2_monolithic_and_pd_equal_tp1(arch, mtp, ray_session, tmp_path):
    tiny = make_mtp_friendly(arch, tmp_path / arch)
    want = LLM(tiny, chunk_size=32, mtp_draft_tokens=mtp).generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)

    mono = LLM(tiny, chunk_size=32, mtp_draft_tokens=mtp, tp_size=2, num_pages=64)
    try:
        assert mono.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == want
        st = mono.stats()
        assert st["pool_free_pages"] == st["pool_total_pages"] == 64
        assert (st["mtp_drafted"] > 0) == (mtp > 0)
    finally:
        mono.shutdown()

    pd = LLM(tiny, chunk_size=32, mtp_draft_tokens=mtp, tp_size=2, pd=True, num_pages=64)
    try:
        # The decode replica knows the prefill replica, each rank its twin.
        [peer] = pd.pd.decode.link.peers.peers()
        assert peer.agent_name == pd.pd.prefill.link.agent.name
        assert pd.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == want
        st = pd.stats()
        assert st["pool_free_pages"] == st["pool_total_pages"] == st["prefill_pool_free_pages"] == 64
        _aborts_free_both_pools(pd)
    finally:
        pd.shutdown()


def _aborts_free_both_pools(llm: LLM) -> None:
    """Abort at every phase (queued, mid-prefill, mid-transfer, mid-decode): both drivers' pools come back."""
    pre, dec = llm.pd.prefill, llm.pd.decode
    p_start, d_start = pre.pool.free_count, dec.pool.free_count
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    def start(rid, n):
        r = Request(rid, random_prompt(n, 300, n), params)
        pages = dec.reserve(r, pre.link.agent.name)
        pre.submit(PrefillTask(rid, r.prompt, params, dec.link.agent.name, pages))
        return r

    def pump(times=1):
        for _ in range(times):
            for res in pre.step():
                dec.on_prefill_result(res)
            dec.step()

    r0 = start("q0", 100)          # queued: reserved, nothing computed
    assert dec.abort("q0")
    pre.abort("q0")
    pump(2)
    r1 = start("m1", 100)          # mid-prefill: 100 tokens at 32 per step
    pump(1)
    assert 0 < pre.active["m1"].done < 100
    dec.abort("m1")                # decode cancels on every rank; each prefill rank is told
    pump(3)
    r2 = start("t2", 20)           # mid-transfer: prefill's answer is lost, as a failed RPC's would be
    for _ in pre.step():
        pass
    assert dec.abort("t2")
    pump(3)
    r3 = start("d3", 20)           # mid-decode
    for _ in range(400):
        pump(1)
        if len(r3.output) >= 2:
            break
        time.sleep(0.01)
    assert len(r3.output) >= 2 and not r3.finished, "request should be decoding"
    assert dec.abort("d3")
    # Decode pages of an aborted receive come back once every rank's prefill twin settled.
    for _ in range(500):
        pump(1)
        if not dec.has_work and not pre.pusher.has_work():
            break
        time.sleep(0.01)
    assert not pre.active and not dec.has_work
    assert pre.pool.free_count == p_start and dec.pool.free_count == d_start
    assert all(r.finish_reason is not None for r in (r0, r1, r2, r3))
