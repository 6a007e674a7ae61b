"""Prefills of one new prompt through static per-bucket buffers (the CUDA-graph path), on CPU.

On CPU the very code a CUDA graph captures runs eagerly on the same static buffers
(``capture=False``): the prompt padded to its token bucket, slots computed from the packed
inputs, pads writing nothing. Its real rows must equal the ordinary eager prefill (up to float
rounding of GEMMs over more rows), the engine's greedy output must be the same with it on, and no
pad may write the cache. The capture and replay are checked on the GPU
(tests/workers/test_prefill_graphs_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from models.batch import ForwardMode
from models.tiny import make_tiny
from tests.workers.prompts import random_prompt
from workers.decode_graphs import default_graph_context
from workers.model_runner import WorkItem
from workers.offline import LLM
from workers.prefill_graphs import (
    ROW_MAX_REQUESTS,
    PrefillGraphPlan,
    PrefillGraphs,
    prefill_buckets,
    prefill_graph_tokens,
    row_cap,
)

TOPK = 160  # the tiny models' index_topk raised, so prompts up to 160 tokens have a bucket


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    return make_tiny(request.param, tmp_path_factory.mktemp(f"prefill-graphs-{request.param}"), seed=4,
                     index_topk=TOPK)


def test_buckets_plan_and_coverage():
    assert prefill_buckets(1024) == (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)
    assert prefill_buckets(100) == (16, 32, 64, 100)
    assert prefill_buckets(16) == (16,)
    assert prefill_buckets(5) == (5,)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        prefill_buckets(0)
    plan = PrefillGraphPlan.for_limits(300)
    assert [plan.bucket(n) for n in (1, 16, 17, 129, 256, 257, 300, 301)] == [16, 16, 32, 256, 256, 300, 300, None]
    assert plan.max_pages == 5
    one = WorkItem((1,) * 40, 0, (3,))
    assert plan.kind([one]) == "prompt"
    assert not plan.covers([one, one])                              # batched prompts: eager
    assert not plan.covers([WorkItem((1,) * 40, 64, (3, 4))])       # over a cached prefix: no rows graphs here
    assert not plan.covers([WorkItem((1,) * 301, 0, tuple(range(5)))])  # longer than the largest bucket
    assert not plan.covers([WorkItem((1,) * 40, 0, {"swa": (3,)})])  # a grouped (DeepSeek-V4) page table
    with pytest.raises(ValueError, match="ascending"):
        PrefillGraphPlan((32, 16))
    plan = PrefillGraphPlan.for_limits(1024, max_context=640)
    assert plan.row_buckets == (16, 32, 64, 128, 256, 384, 512) and plan.context_pages == 10
    assert plan.kind([WorkItem((1,) * 40, 64, (3, 4))]) == "rows"
    assert plan.kind([WorkItem((1,) * 320, 320, tuple(range(10)))]) == "rows"   # context 640: the limit
    assert plan.kind([WorkItem((1,) * 200, 448, tuple(range(11)))]) is None       # context 648 > 640
    assert plan.kind([WorkItem((1,) * 513, 64, tuple(range(10)))]) is None        # more than 512 new tokens
    two = [WorkItem((1,) * 40, 0, (3,)), WorkItem((1,) * 100, 64, (4, 5, 6))]
    assert plan.kind(two) == "rows"                                 # several requests, new or not
    one = [WorkItem((1,), 64, (3, 4))]
    assert plan.kind(one * ROW_MAX_REQUESTS) == "rows" and plan.kind(one * (ROW_MAX_REQUESTS + 1)) is None
    assert plan.kind(two * 3) == "rows" and plan.kind(two * 4) is None    # 512 tokens at most
    assert PrefillGraphPlan.for_limits(100, max_context=640).row_buckets == (16, 32, 64, 100)
    # Long contexts: fewer rows, so that their fp32 logits stay within SUFFIX_LOGITS_BYTES.
    assert row_cap(1024, 9216) == 512 and row_cap(1024, 163840) == 96 and row_cap(1024, 1 << 24) == 16
    assert PrefillGraphPlan.for_limits(1024, max_context=163840).row_buckets == (16, 32, 64, 96)
    with pytest.raises(ValueError, match="max_context"):
        PrefillGraphPlan((16,), (16,), 0)
    assert PrefillGraphPlan((16,), (16,), 64).kind(two[:1] + [WorkItem((), 5, (1,))]) is None  # an empty item
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PrefillGraphs(None, None, None, plan, "cpu", capture=True)


def test_prefill_graph_tokens_resolves_and_refuses():
    class Cfg:
        index_topk, max_position_embeddings = 2048, 4096

    assert prefill_graph_tokens(None, True, Cfg, 4096) == 1024
    assert prefill_graph_tokens(None, True, Cfg, 512) == 512          # capped by the chunk
    assert prefill_graph_tokens(4096, True, Cfg, 8192) == 2048        # and by the top-k
    assert prefill_graph_tokens(0, True, Cfg, 4096) == 0
    assert prefill_graph_tokens(None, False, Cfg, 4096) == 0          # graphs off: none, silently
    assert prefill_graph_tokens(None, True, Cfg, 4096, tp_size=2) == 0
    assert prefill_graph_tokens(None, True, Cfg, 4096, cache_groups=True) == 0
    with pytest.raises(ValueError, match="needs CUDA graphs on"):
        prefill_graph_tokens(512, False, Cfg, 4096)
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        prefill_graph_tokens(512, True, Cfg, 4096, tp_size=2)
    with pytest.raises(ValueError, match="DeepSeek-V4"):
        prefill_graph_tokens(512, True, Cfg, 4096, cache_groups=True)
    with pytest.raises(ValueError, match=">= 0"):
        prefill_graph_tokens(-1, True, Cfg, 4096)


def test_llm_refuses_prefill_graphs_without_cuda_graphs(tiny):
    with pytest.raises(ValueError, match="prefill_graph_max_tokens=64 needs CUDA graphs on"):
        LLM(tiny, prefill_graph_max_tokens=64)


@pytest.mark.parametrize("n", [1, 16, 17, 64, 100, TOPK])
def test_static_prefill_equals_eager_prefill(tiny, n):
    llm = LLM(tiny, num_pages=32)
    runner = llm.runner
    prompt = random_prompt(n, 300, 900 + n)
    pages = llm.pool.allocate_for_tokens(n)
    item = WorkItem(tuple(prompt), 0, tuple(pages))
    try:
        want_batch, want = runner.forward(ForwardMode.PREFILL, [item])
        want_mla = [t.clone() for t in llm.cache.mla]
        runner.enable_prefill_graphs(TOPK, capture=False)
        graphs = runner.prefill_graphs
        calls = []
        run = graphs.run
        graphs.run = lambda items: calls.append(items) or run(items)
        batch, got = runner.forward(ForwardMode.PREFILL, [item])
        assert len(calls) == 1  # the static path served it
        assert got.shape == want.shape == (n, llm.cfg.hidden_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(want_mla, llm.cache.mla):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        # What callers read from the batch: the prompt's rows, lengths on the host and the device.
        assert batch.num_tokens == n and batch.query_ranges() == want_batch.query_ranges() == [(0, n)]
        assert batch.seq_lens.tolist() == batch.q_lens.tolist() == [n]
        assert torch.equal(batch.out_slots, want_batch.out_slots)
        assert torch.equal(batch.positions, want_batch.positions)
    finally:
        llm.pool.free(pages)


def test_pads_never_write_the_cache(tiny):
    llm = LLM(tiny, num_pages=16)
    runner = llm.runner
    runner.enable_prefill_graphs(TOPK, capture=False)
    n = 70  # bucket 128: 58 pad tokens, whose positions 70..127 fall in the prompt's second page
    pages = llm.pool.allocate(2)  # exactly the prompt's pages (70 tokens)
    for t in llm.cache.mla:
        t.fill_(7.0)
    for t in llm.cache.index:
        if t is not None:  # (GLM-5: layers that share top-k have no indexer keys)
            t.fill_(7.0)
    try:
        runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(random_prompt(n, 300, 3)), 0, tuple(pages))])
        slots = set(pages[0] * 64 + i for i in range(64)) | set(pages[1] * 64 + i for i in range(6))
        L = llm.cfg.num_hidden_layers  # (cache layer L, the MTP layer's, is not the target forward's)
        for pool in (*llm.cache.mla[:L], *(t for t in llm.cache.index[:L] if t is not None)):
            flat = pool.reshape(llm.cache.spec.num_slots, -1)
            changed = set((flat != 7.0).any(-1).nonzero().flatten().tolist())
            assert changed == slots, sorted(changed ^ slots)[:8]
    finally:
        llm.pool.free(pages)


def _engine_kw(k: int) -> dict:
    return dict(mtp_draft_tokens=k, max_batch_size=4, chunk_size=256, num_pages=64)


def _graphed_engine(tiny, k: int):
    """An `LLM` whose engine runs prefills through the static-buffer path (prompts up to TOPK, rows over
    cached prefixes), and the list its prefill graphs' `run` calls are appended to (their items)."""
    llm = LLM(tiny, **_engine_kw(k))
    llm.engine.enable_cuda_graphs(default_graph_context(llm.cfg, llm.pool.num_pages), capture=False,
                                  prefill_tokens=TOPK)
    graphs = llm.runner.prefill_graphs
    calls: list = []
    run = graphs.run
    graphs.run = lambda items: calls.append(items) or run(items)
    return llm, graphs, calls


@pytest.mark.parametrize("k", [0, 1])
def test_engine_output_is_unchanged_with_prefill_graphs(tiny, k):
    # Prompts that fit a bucket and ones that do not (longer than top-k: eager), and one long enough
    # to be chunked (its 256-token first chunk eager; its last 44 tokens over the first: a rows graph).
    prompts = [random_prompt(n, 300, 40 + n) for n in (3, 16, 33, 120, TOPK, TOPK + 1, 300)]
    want = LLM(tiny, **_engine_kw(k)).generate(prompts, max_new_tokens=6, ignore_eos=True)
    llm, graphs, calls = _graphed_engine(tiny, k)
    assert graphs.plan.buckets == (16, 32, 64, 128, TOPK)
    # One at a time (every prompt alone in its prefill step), then all together (batched: eager).
    got = [llm.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
    assert got == want
    served = [len(items[0].token_ids) for items in calls]
    assert sorted(served) == [3, 16, 33, 44, 120, TOPK], served
    assert llm.generate(prompts, max_new_tokens=6, ignore_eos=True) == want
    assert llm.pool.free_count == llm.pool.num_pages


SUFFIX_CASES = [(64, 1), (64, 16), (100, 37), (150, 100), (300, 150)]  # (cached, new): some windows past top-k


@pytest.mark.parametrize("cached,n", SUFFIX_CASES)
def test_static_suffix_equals_eager_suffix(tiny, cached, n):
    """New tokens over a cached prefix, as a decode step of one row per token, against the eager prefill
    over the same prefix (the reference backend's ragged indexer and sparse prefill)."""
    llm = LLM(tiny, num_pages=32)
    runner = llm.runner
    prompt = random_prompt(cached + n, 300, 7 * cached + n)
    pages = tuple(llm.pool.allocate_for_tokens(cached + n))
    try:
        runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt[:cached]), 0, pages)])
        item = WorkItem(tuple(prompt[cached:]), cached, pages)
        want_batch, want = runner.forward(ForwardMode.PREFILL, [item])
        want_mla = [t.clone() for t in llm.cache.mla]
        runner.enable_prefill_graphs(TOPK, capture=False, max_context=512)
        assert runner.prefill_graphs.plan.kind([item]) == "rows"
        batch, got = runner.forward(ForwardMode.PREFILL, [item])
        assert runner.prefill_graphs.row_inputs is not None
        assert got.shape == want.shape == (n, llm.cfg.hidden_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(want_mla, llm.cache.mla):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert batch.num_tokens == n and batch.query_ranges() == want_batch.query_ranges() == [(0, n)]
        assert batch.host_lens() == ((cached + n,), (n,))
        assert batch.seq_lens.tolist() == [cached + n] and batch.q_lens.tolist() == [n]
        assert torch.equal(batch.out_slots, want_batch.out_slots)
        assert torch.equal(batch.positions, want_batch.positions)
    finally:
        llm.pool.free(list(pages))


def test_suffix_pads_never_write_the_cache(tiny):
    llm = LLM(tiny, num_pages=16)
    runner = llm.runner
    runner.enable_prefill_graphs(TOPK, capture=False, max_context=512)
    pages = tuple(llm.pool.allocate(3))
    cached, n = 100, 20  # bucket 32: 12 padding rows (position 0, slot -1)
    prompt = random_prompt(cached + n, 300, 11)
    runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt[:cached]), 0, pages)])  # a new prompt: graphs
    L = llm.cfg.num_hidden_layers
    pools = [*llm.cache.mla[:L], *(t for t in llm.cache.index[:L] if t is not None)]
    before = [t.clone() for t in pools]
    suffix = {pages[(cached + i) // 64] * 64 + (cached + i) % 64 for i in range(n)}
    try:
        runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt[cached:]), cached, pages)])
        for a, b in zip(before, pools):
            changed = set((a.reshape(llm.cache.spec.num_slots, -1) != b.reshape(llm.cache.spec.num_slots, -1))
                          .any(-1).nonzero().flatten().tolist())
            assert changed == suffix, sorted(changed ^ suffix)[:8]
    finally:
        llm.pool.free(list(pages))


@pytest.mark.parametrize("k", [0, 1])
def test_engine_output_is_unchanged_with_suffix_graphs(tiny, k):
    """Prompts that share a cached prefix (prefix-cache hits: their suffixes take the rows graphs) give
    the eager engine's greedy output."""
    base = random_prompt(200, 300, 5)
    prompts = [base + random_prompt(m, 300, 60 + m) for m in (1, 9, 40, 130)]
    plain = LLM(tiny, **_engine_kw(k))
    plain.generate([base], max_new_tokens=2, ignore_eos=True)  # the same cache state in both engines
    want = [plain.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
    llm, graphs, calls = _graphed_engine(tiny, k)
    assert graphs.plan.row_buckets == (16, 32, 64, 128, TOPK)
    llm.generate([base], max_new_tokens=2, ignore_eos=True)
    got = [llm.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
    assert got == want
    kinds = [(graphs.plan.kind(items), items[0].start) for items in calls]
    # base (200 tokens, wider than top-k) eagerly; then each prompt's suffix after the cached pages of base
    # (3 full pages: 192 tokens; a page's key covers the token after it, so the 4th is not shared)
    assert kinds == [("rows", 192)] * len(prompts), kinds
    assert llm.pool.free_count == llm.pool.num_pages


def test_static_rows_equal_eager_for_a_batch(tiny):
    """Several requests in one rows step (a new prompt, prefix hits, a one-token suffix) against the same
    PREFILL batch run eagerly: each request's rows see its own pages and context only."""
    llm = LLM(tiny, num_pages=64)
    runner = llm.runner
    shapes = [(0, 37), (64, 5), (150, 100), (300, 1)]  # (cached, new): windows past top-k in the third
    prompts = [random_prompt(c + n, 300, 500 + c + n) for c, n in shapes]
    tables = [tuple(llm.pool.allocate_for_tokens(c + n)) for c, n in shapes]
    try:
        for (c, _), p, t in zip(shapes, prompts, tables):
            if c:
                runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(p[:c]), 0, t)])
        items = [WorkItem(tuple(p[c:]), c, t) for (c, _), p, t in zip(shapes, prompts, tables)]
        want_batch, want = runner.forward(ForwardMode.PREFILL, items)
        want_mla = [t.clone() for t in llm.cache.mla]
        runner.enable_prefill_graphs(TOPK, capture=False, max_context=512)
        assert runner.prefill_graphs.plan.kind(items) == "rows"
        batch, got = runner.forward(ForwardMode.PREFILL, items)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(want_mla, llm.cache.mla):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert batch.query_ranges() == want_batch.query_ranges()
        assert batch.host_lens() == want_batch.host_lens()
        assert batch.seq_lens.tolist() == [c + n for c, n in shapes] and batch.q_lens.tolist() == [n for _, n in shapes]
        assert torch.equal(batch.out_slots, want_batch.out_slots) and torch.equal(batch.positions, want_batch.positions)
    finally:
        for t in tables:
            llm.pool.free(list(t))
