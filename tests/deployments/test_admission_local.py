"""Queue timeouts of the worker threads, without Ray (deployments/admission.py).

A monolithic decode replica's thread, built as `DecodeServer` builds it but with a pool that one
long request fills: a second request waits in the engine's queue and is refused ``overloaded:
decode queue timeout`` at its ``admit_by`` time (429 at the ingress), a third that arrives past
it is refused at once, and the pool is whole after. A prefill replica's thread refuses a task
that arrives past its time before any handshake, and one that waited in its queue past it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.admission import overload_reason
from deployments.app_config import AppConfig
from deployments.decode_thread import DecodeThread
from deployments.prefill_thread import PrefillThread
from deployments.replica_build import build_decode_worker, build_prefill_worker
from tests.deployments.app_fixtures import merged, yaml_args
from workers.prefill_worker import PrefillTask
from workers.request import Request
from workers.sample.params import SamplingParams

TIMEOUT_S = 1.0
WAIT_S = 0.25
"""The waiting request's admit_by (its refusal names the replica's queue_timeout_s, TIMEOUT_S)."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _cfg(name: str, cache: str, **sections) -> AppConfig:
    raw = yaml_args(name)
    raw = merged(raw, model={**raw["model"], "cache_dir": cache}, **sections)
    return AppConfig.model_validate(raw)


@pytest.fixture(scope="module")
def mono(cache):
    # 32 pages: a prompt of 1900 tokens takes 30 of them, and its decode the other two.
    cfg = _cfg("tiny_mono.yaml", cache, decode={"num_pages": 32}, limits={"queue_timeout_s": TIMEOUT_S})
    model_dir = str(cfg.model.checkpoint_dir(make=True))
    thread = DecodeThread(build_decode_worker(cfg, model_dir, "decode-admission"), "decode-admission", TIMEOUT_S)
    thread.start()
    yield cfg, thread
    thread.stop()


async def _first(stream: asyncio.Queue, timeout_s: float = 60.0):
    return await asyncio.wait_for(stream.get(), timeout_s)


def test_a_request_waiting_for_pages_past_its_time_is_refused(mono):
    cfg, thread = mono

    async def run():
        long = thread.open_stream("long")
        waiting = thread.open_stream("waiting")
        late = thread.open_stream("late")
        try:
            # The engine takes pages as a request grows, so the long one must hold them already: a long
            # prompt (30 pages), then 140 tokens (the last 2) that keep it running well past TIMEOUT_S.
            thread.post(thread.add, Request("long", [5] * 1900, SamplingParams(max_new_tokens=140, ignore_eos=True)),
                        time.time() + 60)
            assert (await _first(long)).error is None  # prefilled, decoding
            t0 = time.monotonic()
            # Its own admit_by, well inside the long request's 140 decode steps (the pool's size bounds
            # them): at 1 s, a fast CPU finished them first once, and the waiting request started.
            thread.post(thread.add, Request("waiting", [6] * 200, SamplingParams(max_new_tokens=8)),
                        time.time() + WAIT_S)
            refused = await _first(waiting)
            waited_s = time.monotonic() - t0
            thread.post(thread.add, Request("late", [7] * 10, SamplingParams(max_new_tokens=2)), time.time() - 1)
            return refused, waited_s, await _first(late), thread.snapshot()
        finally:
            thread.post(thread.abort, "long")
            for rid in ("long", "waiting", "late"):
                thread.close_stream(rid)

    refused, waited_s, late, busy = asyncio.run(run())
    for out in (refused, late):
        assert out.finished and out.finish_reason == "error" and out.token_ids == []
        assert overload_reason(out.error) == ("decode", "queue_timeout"), out.error
        assert "not started within 1s" in out.error
    # Refused at its time (checked every EXPIRE_EVERY_S), not when the long request ends.
    assert WAIT_S <= waited_s < WAIT_S + 2
    print(f"refused after {waited_s:.2f}s (admit_by {WAIT_S}s after it was sent)")
    assert busy.running == 1 and thread.admit_by == {}
    _wait_whole(thread, cfg.decode.num_pages)


def test_requests_that_start_in_time_are_untouched(mono):
    cfg, thread = mono

    async def run():
        outs = []
        stream = thread.open_stream("ok")
        try:
            thread.post(thread.add, Request("ok", [8] * 30, SamplingParams(max_new_tokens=5, ignore_eos=True)),
                        time.time() + TIMEOUT_S)
            while not (outs and outs[-1].finished):
                outs.append(await _first(stream))
            await asyncio.sleep(TIMEOUT_S + 0.2)  # past its admit_by: nothing more comes
            assert stream.empty()
            return outs
        finally:
            thread.close_stream("ok")

    outs = asyncio.run(run())
    assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 5
    assert thread.admit_by == {}
    _wait_whole(thread, cfg.decode.num_pages)


def test_prefill_refuses_tasks_past_their_time(cache):
    cfg = _cfg("tiny_pd.yaml", cache, limits={"queue_timeout_s": TIMEOUT_S})
    worker = build_prefill_worker(cfg, str(cfg.model.checkpoint_dir(make=True)), "prefill-admission")
    thread = PrefillThread(worker, warm_up=False, queue_timeout_s=TIMEOUT_S)

    async def run():
        late, queued = thread.open_stream("late"), thread.open_stream("queued")
        # Arrived past its time: refused before the handshake (its decode agent is unknown here).
        thread.submit(PrefillTask("late", [1] * 10, SamplingParams(), "nobody", [0]), None, time.time() - 1)
        # Waited in the queue past its time (as behind a long prompt): refused by the expiry check.
        thread.pending.append(PrefillTask("queued", [1] * 10, SamplingParams(), "nobody", [1]))
        thread.admit_by["queued"] = time.time() - 0.01
        thread._expire()
        return await _first(late, 5), await _first(queued, 5)

    try:
        results = asyncio.run(run())
    finally:
        worker.link.close()  # its NIXL agent's progress thread would poll a core until collected
    for res in results:
        assert not res.ok and overload_reason(res.error) == ("prefill", "queue_timeout"), res.error
    assert not thread.pending and thread.admit_by == {}
    assert worker.pool.free_count == worker.pool.num_pages


def _wait_whole(thread: DecodeThread, pages: int, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        s = thread.stats
        if s.free_pages == pages and s.requests == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"pool not whole: {thread.stats}")
