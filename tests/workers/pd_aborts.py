"""Abort a request at every phase of a disaggregated prefill/decode pair (one helper for every test)."""

from __future__ import annotations

import time

from tests.workers.prompts import random_prompt
from workers.prefill_worker import PrefillTask
from workers.request import Request
from workers.sample.params import SamplingParams


def abort_at_every_phase(pre, dec, prefix: list[int] = ()) -> None:
    """Queued, mid-prefill, mid-transfer and mid-decode aborts on a prefill worker
    ``pre`` and a decode worker ``dec`` driven in this process (prefill chunks of
    32 tokens); asserts both pools come back to their starting free counts.
    ``prefix``: tokens every prompt starts with (e.g. pages already in both pools'
    prefix caches: the aborted requests then hold shared cached pages)."""
    p_start, d_start = pre.pool.free_count, dec.pool.free_count
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    def start(rid, n):
        r = Request(rid, list(prefix) + random_prompt(n, 300, n), params)
        pages = dec.reserve(r, pre.link.agent.name)
        pre.submit(PrefillTask(rid, r.prompt, params, dec.link.agent.name, pages, r.cached_pages))
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
    assert len(prefix) < pre.active["m1"].done < len(prefix) + 100
    dec.abort("m1")                # decode cancels: prefill is told and frees its pages
    pump(3)
    r2 = start("t2", 20)           # mid-transfer: prefill's answer is lost, as a failed RPC's would be
    for _ in pre.step():
        pass
    assert dec.abort("t2")
    pump(3)
    r3 = start("d3", 20)           # mid-decode
    for _ in range(400):           # bounded: NIXL completes the push within a few polls
        pump(1)
        if len(r3.output) >= 2:
            break
        time.sleep(0.01)
    assert len(r3.output) >= 2 and not r3.finished, "request should be decoding"
    assert dec.abort("d3")
    # Aborted receives hold their decode pages until prefill has answered the
    # cancel (a WRITE it posted could still land): pump until it has.
    for _ in range(500):
        pump(1)
        if not dec.has_work and not pre.pusher.has_work():
            break
        time.sleep(0.01)
    assert not pre.active and not dec.has_work
    assert pre.pool.free_count == p_start and dec.pool.free_count == d_start
    assert all(r.finish_reason is not None for r in (r0, r1, r2, r3))
