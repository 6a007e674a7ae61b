"""The decode worker thread of a monolithic replica, without Ray: the worker built the way
`DecodeServer` builds it for ``configs/tiny_mono.yaml`` (no NIXL link), driven through the
thread's commands and streams as the replica drives it.

Checked: the worker has no link and the thread no warm-up page; concurrent requests' outputs
equal `LLM(pd=False)`'s token for token (logprobs too); a request the pool can never hold and
a duplicate id come back as error outputs (the first, as a PD replica's full pool: 503
``overloaded``); an abort mid-decode gives every page back; the stats are `DecodeStats`.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.app_config import AppConfig
from deployments.decode_thread import DecodeThread
from deployments.replica_build import build_decode_worker
from deployments.replica_stats import DecodeStats
from tests.deployments.app_fixtures import yaml_args
from tests.workers.prompts import random_prompt
from workers.offline import LLM
from workers.request import Request
from workers.sample.params import SamplingParams

RAW = yaml_args("tiny_mono.yaml")
PROMPTS = [random_prompt(n, 256, seed=n) for n in (1, 37, 64, 65, 300)]  # 300: two 256-token chunks
TOKENS = 10


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> AppConfig:
    raw = {**RAW, "model": {**RAW["model"], "cache_dir": str(tmp_path_factory.mktemp("cache"))}}
    return AppConfig.model_validate(raw)


@pytest.fixture(scope="module")
def model_dir(cfg):
    return str(cfg.model.checkpoint_dir(make=True))


@pytest.fixture(scope="module")
def reference(cfg, model_dir):
    d = cfg.decode
    llm = LLM(model_dir, backend=d.backend, device=d.device, dtype=d.dtype, kv_cache_dtype=d.kv_cache_dtype,
              num_pages=d.num_pages, chunk_size=d.chunk_size, max_batch_size=d.max_batch_size)
    reqs = [Request(f"ref{i}", p, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        assert llm.engine.add_request(r) is None
    while any(not r.finished for r in reqs):
        llm.engine.step()
    return [(r.output, r.logprobs) for r in reqs]


@pytest.fixture
def thread(cfg, model_dir):
    worker = build_decode_worker(cfg, model_dir, "decode-local")
    t = DecodeThread(worker, "decode-local")
    t.start()
    yield t
    t.stop()


async def _collect(thread: DecodeThread, rid: str, prompt: list[int], params: SamplingParams):
    stream = thread.open_stream(rid)
    try:
        thread.post(thread.add, Request(rid, list(prompt), params))
        outs = []
        while not (outs and outs[-1].finished):
            outs.append(await asyncio.wait_for(stream.get(), 120))
        return outs
    finally:
        thread.close_stream(rid)


def test_no_link_no_warmup_page(thread, cfg):
    assert thread.worker.link is None and thread.worker.receiver is None and thread.warmup_page is None
    assert thread.agent_name == "decode-local"
    s = thread.snapshot()
    assert isinstance(s, DecodeStats)
    assert (s.free_pages, s.total_pages, s.reserved_pages, s.known_prefills, s.held_pages) == (
        cfg.decode.num_pages, cfg.decode.num_pages, 0, 0, 0)
    with pytest.raises(RuntimeError, match="no KV link"):
        thread.worker.reserve(Request("x", [1, 2], SamplingParams()), None)


def test_concurrent_requests_equal_the_offline_engine(thread, cfg, reference):
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(_collect(thread, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    for outs, (tokens, logprobs) in zip(results, reference):
        assert [t for o in outs for t in o.token_ids] == tokens
        assert [lp for o in outs for lp in o.logprobs] == pytest.approx(logprobs, abs=1e-5)
        assert outs[-1].finish_reason == "length" and not any(o.error for o in outs)
    assert thread.stats is not None
    s = thread.snapshot()
    assert s.free_pages == cfg.decode.num_pages and s.running == s.queued == 0 and s.decode_tokens > 0


def test_refusals_are_error_outputs(thread, cfg):
    async def run():
        # prompt + max_new_tokens beyond what 512 pages hold: the engine refuses it at once.
        too_big = await _collect(thread, "big", [5] * 10, SamplingParams(max_new_tokens=64 * cfg.decode.num_pages))
        # A duplicate id while the first is running.
        first = thread.open_stream("dup")
        thread.post(thread.add, Request("dup", [7] * 20, SamplingParams(max_new_tokens=200, ignore_eos=True)))
        await asyncio.wait_for(first.get(), 120)  # running
        thread.post(thread.add, Request("dup", [7] * 20, SamplingParams(max_new_tokens=2)))
        dup = await asyncio.wait_for(first.get(), 120)
        while not dup.error:  # the first one's outputs go on the same stream
            dup = await asyncio.wait_for(first.get(), 120)
        thread.post(thread.abort, "dup")
        thread.close_stream("dup")
        return too_big, dup

    (big,), dup = asyncio.run(run())
    assert big.finished and big.finish_reason == "error" and big.token_ids == []
    assert big.error.startswith("overloaded: decode page pool: request needs ")
    assert dup.finish_reason == "error" and "duplicate request id 'dup'" in dup.error
    _wait_whole(thread, cfg)


def test_abort_mid_decode_frees_every_page(thread, cfg):
    async def run():
        stream = thread.open_stream("long")
        thread.post(thread.add, Request("long", [9] * 150, SamplingParams(max_new_tokens=1500, ignore_eos=True)))
        for _ in range(3):
            await asyncio.wait_for(stream.get(), 120)
        busy = thread.snapshot()
        thread.post(thread.abort, "long")
        thread.close_stream("long")
        return busy

    busy = asyncio.run(run())
    assert busy.running == 1 and busy.free_pages < cfg.decode.num_pages
    _wait_whole(thread, cfg)


def _wait_whole(thread: DecodeThread, cfg, timeout_s: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        s = thread.stats
        if s.free_pages == cfg.decode.num_pages and s.requests == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"pool not whole: {thread.stats}")


def test_an_engine_failure_ends_every_request_as_unavailable(thread):
    """A step that raises fails the thread: each open request ends with an error the ingress answers 503 (a
    fault of the replica, as when an engine process dies), and the health check fails."""
    from deployments.worker_thread import ENGINE_FAILED, WorkerThreadFailed
    from workers.request import unavailable

    real_step = thread.worker.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected step failure")
        return real_step()

    thread.worker.step = failing_step

    async def run():
        stream = thread.open_stream("victim")
        thread.post(thread.add, Request("victim", [5] * 30, SamplingParams(max_new_tokens=500, ignore_eos=True)))
        while True:
            out = await asyncio.wait_for(stream.get(), 120)
            if out.finished:
                return out

    out = asyncio.run(run())
    assert out.finish_reason == "error" and out.error.startswith(unavailable(ENGINE_FAILED)), out.error
    assert "injected step failure" in out.error
    with pytest.raises(WorkerThreadFailed):
        thread.check()


def test_graph_context_defaults_to_what_a_served_request_can_reach(cfg):
    """The graphs' context (their indexer logits' width): ``cuda_graph_max_context`` when set, else the
    pool's capacity for one request capped by the model's positions and ``model.max_model_len``."""
    from types import SimpleNamespace

    from deployments.replica_build import _graph_context

    parts = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=163840)),
                            pool=SimpleNamespace(num_pages=2368))
    plain = cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_model_len": None})})
    assert _graph_context(plain, plain.decode, parts) == 2368 * 64
    capped = cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_model_len": 9216})})
    assert _graph_context(capped, capped.decode, parts) == 9216
    fixed = capped.model_copy(update={"decode": capped.decode.model_copy(update={"cuda_graph_max_context": 4096})})
    assert _graph_context(fixed, fixed.decode, parts) == 4096
