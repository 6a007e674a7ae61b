"""Tensor-parallel replicas through the offline API: rank workers in real Ray
actors (gloo), driven by one engine; PD pushes rank i -> rank i over real NIXL.

Greedy output with tp_size 2 equals tp_size 1, monolithic and PD, and every
page pool (the driver's, and with PD both sides') returns to its start count.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import ray

from tests.workers.mtp_friendly import make_mtp_friendly
from tests.workers.pd_aborts import abort_at_every_phase
from tests.workers.prompts import random_prompt
from workers.decode_graphs import default_graph_context
from workers.group_link import group_agent_name, rank_agent_name
from workers.offline import LLM
from workers.rank_rows import SampledTokens

# Chunks of 32 split the 70- and 100-token prompts: prefill pushes several chunks per rank.
PROMPTS = [random_prompt(n, 300, 200 + n) for n in (70, 5, 100, 64)]
NEW = 8
RUNS_ALONE = "it starts a Ray cluster and six rank actors (tests/schedule.py)"


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
    one = LLM(tiny, chunk_size=32, mtp_draft_tokens=mtp)
    want = one.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    sampled = dict(max_new_tokens=NEW, ignore_eos=True, temperature=0.9, top_k=20, seed=11)

    mono = LLM(tiny, chunk_size=32, mtp_draft_tokens=mtp, tp_size=2, num_pages=64)
    try:
        assert mono.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == want
        if not mtp:  # rank 0 samples (`GroupModel.sample_hidden`): seeded draws and logprobs as one process's
            assert mono.generate(PROMPTS, **sampled) == one.generate(PROMPTS, **sampled)
            # Prompt logprobs: the head on rank 0 over the rows its forward kept (`workers.rank_rows`).
            got, ref = (llm.logprob_requests(PROMPTS[:2], max_new_tokens=3, logprobs=2, prompt_logprobs=1)
                        for llm in (mono, one))
            for g, r in zip(got, ref):
                assert g.output == r.output
                assert len(g.logprobs) == 3 and max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) < 1e-4
                gp, rp = g.prompt_logprobs, r.prompt_logprobs
                assert len(gp.logprobs) == len(rp.logprobs) == len(g.prompt) - 1
                assert max(abs(a - b) for a, b in zip(gp.logprobs, rp.logprobs)) < 1e-4
                assert [list(t) for t in gp.top] == [list(t) for t in rp.top]
        st = mono.stats()
        assert st["pool_free_pages"] == st["pool_total_pages"] == 64
        assert (st["mtp_drafted"] > 0) == (mtp > 0)
        decode_through_rank_graphs(mono, want, sampled, one.generate(PROMPTS, **sampled) if not mtp else None)
        kept_rows_are_the_forwards(mono, one)
        a_dead_rank_fails_the_step(mono)
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
        abort_at_every_phase(pd.pd.prefill, pd.pd.decode)
    finally:
        pd.shutdown()




def decode_through_rank_graphs(llm: LLM, want, sampled: dict, want_sampled) -> None:
    """Each rank's decode graphs (static buffers on CPU: the capture's own path without the capture)
    give the same greedy and seeded output as the eager steps, with one call per rank per decode step
    (the step and rank 0's sampling together: `workers.rank_rows.RankHidden`), with overlap scheduling
    (step n + 1 starts before step n is read; its input tokens broadcast from rank 0) and without. With
    MTP drafts the engine refuses them (a verify is wider than one token)."""
    max_context = default_graph_context(llm.cfg, llm.pool.num_pages)
    if len(llm.model.mtp) and llm.engine.k:
        with pytest.raises(ValueError, match="width-1 steps only"):
            llm.engine.enable_cuda_graphs(max_context, capture=False)
        return
    llm.engine.enable_cuda_graphs(max_context, capture=False)
    group = llm.groups[0]
    calls: list[str] = []
    rank0: list[str] = []
    real_submit, real_call_rank = group.submit, group.call_rank

    def counted(method, *args):  # the real fan-out (every call to all ranks), observed
        calls.append(method)
        if method == "decode_sample" and args[1] is not None and isinstance(args[1][1], SampledTokens):
            calls.append("tokens from rank 0")
        return real_submit(method, *args)

    def counted_rank(rank, method, *args):
        rank0.append(method)
        return real_call_rank(rank, method, *args)

    group.submit, group.call_rank = counted, counted_rank
    try:
        assert llm.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == want
        assert llm.generate(PROMPTS, **sampled) == want_sampled
        # Overlap scheduling off: every step read back before the next (the tokens come from the host).
        cfg = llm.engine.cfg
        llm.engine.cfg = dataclasses.replace(cfg, overlap=False)
        assert llm.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == want
    finally:
        del group.submit, group.call_rank
        llm.engine.cfg = cfg
    assert calls.count("decode_sample") >= 3 * (NEW - 1)
    assert calls.count("tokens from rank 0") >= NEW - 2  # overlapped steps fed from rank 0's device
    assert not [c for c in calls if c not in ("forward", "decode_sample", "tokens from rank 0")], calls
    # The prefill forwards' hidden states stayed on the ranks: rank 0 sampled the prompts' last rows
    # where they were (`workers.rank_rows`), and no call brought rows or logits back.
    assert rank0 and set(rank0) == {"sample_kept"}, rank0
    st = llm.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"]


def kept_rows_are_the_forwards(llm: LLM, one: LLM) -> None:
    """A tp 2 forward's hidden states stay on the ranks (`workers.rank_rows.RankRows`): selected,
    sliced and concatenated handles fetch the same rows as one process's forward; a handle used after
    the next forward raises instead of reading that forward's rows."""
    import torch

    from models.batch import ForwardMode
    from workers.model_runner import WorkItem
    from workers.rank_rows import RankRows

    prompt = PROMPTS[0]
    hidden = {}
    for name, m in (("tp2", llm), ("tp1", one)):
        pages = m.pool.allocate_for_tokens(len(prompt))
        try:
            _, hidden[name] = m.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt), 0, tuple(pages))])
        finally:
            m.pool.free(pages)
    h, ref = hidden["tp2"], hidden["tp1"]
    assert isinstance(h, RankRows) and h.shape == ref.shape
    picked = torch.cat([h[3:7], h.index_select(0, torch.tensor([60, 1]))])
    assert isinstance(picked, RankRows) and picked.shape[0] == 6
    want = torch.cat([ref[3:7], ref[[60, 1]]])
    torch.testing.assert_close(picked.materialize(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.nn.functional.rms_norm(h[:2], (h.shape[1],)),
                               torch.nn.functional.rms_norm(ref[:2], (ref.shape[1],)), rtol=1e-4, atol=1e-4)
    stale = h[:1]
    pages = llm.pool.allocate_for_tokens(5)
    try:
        llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt[:5]), 0, tuple(pages))])
    finally:
        llm.pool.free(pages)
    with pytest.raises(RuntimeError, match="after the next forward"):  # on the driver: the ranks are fine
        stale.materialize()
    assert llm.groups[0].broken is None


def a_dead_rank_fails_the_step(llm: LLM) -> None:
    """A rank that dies mid-generation fails the engine's step with `RankGroupFailed` as soon as the
    driver reads a step (overlapped steps are read a step late), not a wait on the survivor stuck in
    a collective; the group then refuses every later call."""
    from workers.rank_group import RankGroupFailed

    group = llm.groups[0]
    ray.kill(group.actors[1])
    with pytest.raises(RankGroupFailed):
        llm.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    assert group.broken is not None
    with pytest.raises(RankGroupFailed, match="failed earlier"):
        group.call("two_batch_forwards")
