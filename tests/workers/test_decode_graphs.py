"""Decode steps through static per-bucket buffers (the CUDA-graph path), on CPU.

On CPU the very code a CUDA graph captures runs eagerly on the same static
buffers (``capture=False``): padded buckets, in-place input updates, the MoE's
static-shape branch and the host-side logits width. Greedy output must equal
the ordinary decode path's, and padding rows must never write the cache. The
graph capture and replay themselves are checked on the H100
(tests/workers/test_decode_graphs_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from attention.backend import get_backend
from tests.workers.mtp_friendly import make_mtp_friendly
from tests.workers.prompts import random_prompt
from workers.decode_graphs import (
    DecodeGraphPlan,
    DecodeGraphs,
    default_graph_context,
    graph_batch_sizes,
    graphs_wanted,
)
from workers.model_runner import WorkItem, host_batch
from workers.offline import LLM

LENGTHS = (1, 64, 65, 128, 150, 9, 30)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    return make_mtp_friendly(request.param, tmp_path_factory.mktemp(f"graphs-{request.param}"))


def test_buckets_and_plan():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    plan = DecodeGraphPlan(2, (1, 2, 4, 8), max_pages=3)
    assert [plan.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert plan.max_context == 192
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphPlan(1, (4, 2), 1)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(None, None, None, plan, "cpu", capture=True)


def test_graphs_wanted():
    assert graphs_wanted(None, "reference", "cpu") is False
    assert graphs_wanted(False, "cuda", "cpu") is False
    with pytest.raises(ValueError, match="needs backend='cuda' on a CUDA device"):
        graphs_wanted(True, "reference", "cpu")


@pytest.mark.parametrize("k", [0, 2])
def test_static_decode_equals_eager_decode(tiny, k):
    prompts = [random_prompt(n, 300, 50 + n) for n in LENGTHS]
    # Different max_new_tokens: the batch shrinks step by step, so live rows
    # move between buckets and rows that were live become padding.
    want_llm = LLM(tiny, mtp_draft_tokens=k, max_batch_size=5, chunk_size=96)
    want = [want_llm.generate([p], max_new_tokens=6 + i, ignore_eos=True)[0] for i, p in enumerate(prompts)]

    llm = LLM(tiny, mtp_draft_tokens=k, max_batch_size=5, chunk_size=96)
    llm.engine.enable_cuda_graphs(max_context=default_graph_context(llm.cfg, llm.pool.num_pages), capture=False)
    graphs = llm.runner.decode_graphs[k + 1]
    assert graphs.plan.batch_sizes == (1, 2, 4, 5)
    reqs = []
    from workers.request import Request
    from workers.sample.params import SamplingParams

    for i, p in enumerate(prompts):
        reqs.append(Request(f"r{i}", list(p), SamplingParams(max_new_tokens=6 + i, ignore_eos=True)))
        assert llm.engine.add_request(reqs[-1]) is None
    seen_sizes = set()
    calls = []
    run = graphs.run

    def counting_run(*args):
        calls.append(len(args[0]))
        return run(*args)

    graphs.run = counting_run
    while llm.engine.has_work:
        llm.engine.step()
        seen_sizes.update(calls)
    assert [r.output for r in reqs] == want
    # The static path served the decode steps, at several batch sizes.
    assert len(seen_sizes) >= 3, seen_sizes
    assert llm.pool.free_count == llm.pool.num_pages


def test_plan_logits_widths():
    plan = DecodeGraphPlan.for_limits(1, 4, 9216, (8128, 9216))
    assert (plan.max_pages, plan.logits_pages) == (144, (127, 144))
    assert plan.keys() == [(b, p) for b in (1, 2, 4) for p in (127, 144)]
    assert [plan.logits_width(n) for n in (1, 8128, 8129, 9216)] == [127, 127, 144, 144]
    assert DecodeGraphPlan.for_limits(1, 4, 4096, (8128, 4096)).logits_pages == (64,)  # nothing narrower to add
    assert DecodeGraphPlan(1, (4,), 3).logits_pages == (3,)
    with pytest.raises(ValueError, match="ending at max_pages"):
        DecodeGraphPlan(1, (4,), 3, (1, 2))
    with pytest.raises(ValueError, match="beyond this plan"):
        plan.logits_width(9217)


def test_steps_take_the_narrowest_logits_width_that_holds_them(tiny):
    """A backend asking for a narrower logits width (the cuda backend's: below its sampled top-k) gets graphs
    of both; each step runs the narrowest holding its longest context, and the output is the plain engine's."""
    import dataclasses

    prompts = [random_prompt(n, 300, 80 + n) for n in (100, 20, 150)]
    want = LLM(tiny, max_batch_size=4).generate(prompts, max_new_tokens=40, ignore_eos=True)
    llm = LLM(tiny, max_batch_size=4)
    llm.runner.backend = dataclasses.replace(llm.runner.backend, decode_logits_widths=lambda m: (128, m))
    llm.engine.enable_cuda_graphs(max_context=default_graph_context(llm.cfg, llm.pool.num_pages), capture=False)
    graphs = llm.runner.decode_graphs[1]
    assert graphs.plan.logits_pages == (2, graphs.plan.max_pages)
    assert graphs.inputs.batch(4, 2).max_seq_len == 128 and graphs.inputs.batch(4).max_seq_len == graphs.plan.max_context
    assert llm.generate(prompts[:2], max_new_tokens=40, ignore_eos=True) == want[:2]
    # 100 + 40 tokens: the 100-token prompt's steps past 128 tokens took the wide graphs, the others the narrow.
    assert graphs.width_steps[2] > 0 and graphs.width_steps[graphs.plan.max_pages] > 0, graphs.width_steps
    narrow = graphs.width_steps[2]
    assert llm.generate(prompts[2:], max_new_tokens=40, ignore_eos=True) == want[2:]
    assert graphs.width_steps[2] == narrow  # a 150-token context never fits 2 pages
    assert llm.pool.free_count == llm.pool.num_pages


def test_padding_rows_never_write_the_cache(tiny):
    llm = LLM(tiny, max_batch_size=4)
    be = get_backend("reference")
    plan = DecodeGraphPlan(1, (4,), max_pages=2)
    graphs = DecodeGraphs(llm.model, llm.cache, be, plan, "cpu", capture=False)
    pages = [llm.pool.allocate(2) for _ in range(3)]
    keys = [f"r{r}" for r in range(3)]
    graphs.run(keys, [5, 6, 7], [11, 12, 13], pages)
    before = [t.clone() for t in llm.cache.mla]
    # Now one live row: rows 1..3 of the bucket are padding; the rows that
    # were live in the previous step must not write again.
    graphs.run(keys[:1], [5], [11], pages[:1])
    assert graphs.inputs.num_rows == 1
    slot = pages[0][0] * 64 + 10
    for layer, (a, b) in enumerate(zip(before, llm.cache.mla)):
        flat_a = a.view(llm.cache.spec.num_slots, -1)
        flat_b = b.reshape(llm.cache.spec.num_slots, -1)  # the live pool is a strided view
        changed = (flat_a != flat_b).any(-1).nonzero().flatten().tolist()
        assert changed in ([], [slot]), (layer, changed, slot)
    for p in pages:
        llm.pool.free(p)


def test_out_of_plan_steps_run_eagerly(tiny):
    llm = LLM(tiny, max_batch_size=2)
    llm.engine.enable_cuda_graphs(max_context=64, capture=False)
    graphs = llm.runner.decode_graphs[1]
    assert graphs.covers(2, 1, 1) and not graphs.covers(3, 1, 1) and not graphs.covers(1, 2, 1)
    assert not graphs.covers(1, 1, 2)
    prompt = random_prompt(100, 300, 7)  # 2 pages: beyond the 64-token plan
    want = LLM(tiny).generate([prompt], max_new_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="outside this plan"):
        graphs.run(["r"], [1], [100], [[0, 1]])
    assert llm.generate([prompt], max_new_tokens=4, ignore_eos=True) == want


def test_static_moe_equals_routed_moe(tiny):
    llm = LLM(tiny)
    moes = [layer.mlp for layer in llm.model.layers if layer.is_moe]
    assert moes
    x = torch.randn(11, llm.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for moe in moes:
        torch.testing.assert_close(moe(x, static_shapes=True), moe(x), rtol=1e-5, atol=1e-6)


def test_persistent_rows_follow_joins_growth_and_leaves(tiny):
    """The rows kept between steps (joins, a new page, a leave that moves the
    last row, a new key order) give what a fresh batch of the same step gives."""
    llm = LLM(tiny, max_batch_size=4)
    be = get_backend("reference")
    plan = DecodeGraphPlan(1, (4,), max_pages=3)
    kept = DecodeGraphs(llm.model, llm.cache, be, plan, "cpu", capture=False)
    pages = {k: llm.pool.allocate(1) for k in "abcd"}
    ctx = {"a": 62, "b": 20, "c": 30, "d": 5}
    steps = [["a", "b", "c"], ["c", "a"], ["d", "c", "a"], ["a"]]
    for n, keys in enumerate(steps):
        for k in keys:
            ctx[k] += 1
            if ctx[k] > 64 * len(pages[k]):
                pages[k] += llm.pool.allocate(1)
        args = (keys, [3 + n + i for i in range(len(keys))], [ctx[k] for k in keys], [pages[k] for k in keys])
        got = kept.run(*args).clone()
        fresh = DecodeGraphs(llm.model, llm.cache, be, plan, "cpu", capture=False).run(*args)
        torch.testing.assert_close(got, fresh, rtol=1e-5, atol=1e-5)
        assert kept.inputs.num_rows == len(keys)
        rows = kept.inputs.assign(keys, [pages[k] for k in keys])
        for k, r in zip(keys, rows):
            table = kept.inputs.page_tables[r].tolist()
            assert table[: len(pages[k])] == pages[k] and not any(table[len(pages[k]):]), (n, k, table)
    assert len(pages["a"]) == 2  # the growth case happened
    # A request that lost its pages (preempted) comes back with new ones of the same
    # count: a new list, so its row is rewritten, not kept.
    old = pages["a"]
    pages["a"] = llm.pool.allocate(2)
    kept.run(["a"], [9], [ctx["a"] + 1], [pages["a"]])
    assert kept.inputs.page_tables[0].tolist()[:2] == pages["a"] != old
    llm.pool.free(old)
    for p in pages.values():
        llm.pool.free(p)
