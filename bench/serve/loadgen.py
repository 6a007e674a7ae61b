"""The load: send requests at their arrival times, at most ``max_concurrency`` at once.

Each request is a task started at its arrival offset (``bench.serve.arrivals``),
and one that follows another (``SampleRequest.follows``, a multi-turn
conversation's next turn) then waits until that one has ended;
with ``max_concurrency`` it then waits for a free slot, and its clock starts
when it is sent (as ``vllm bench serve``): a request queued behind the limit
does not count that wait in its TTFT. The benchmark duration (seconds) runs
from the first arrival to the last request's end.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from collections.abc import Awaitable, Callable, Sequence

from bench.serve.arrivals import arrival_offsets
from bench.serve.datasets import SampleRequest
from bench.serve.metrics import RequestResult
from bench.serve.progress import Progress

Send = Callable[[SampleRequest], Awaitable[RequestResult]]


async def run_load(requests: Sequence[SampleRequest], send: Send, *, request_rate: float = float("inf"),
                   burstiness: float = 1.0, seed: int | None = 0, max_concurrency: int | None = None,
                   progress: Progress | None = None) -> tuple[list[RequestResult], float]:
    """(results in ``requests`` order, duration in seconds)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, not {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult | None] = [None] * len(requests)

    ended = [asyncio.Event() for _ in requests]

    async def one(i: int, req: SampleRequest) -> None:
        try:
            await _send(i, req)
        finally:
            ended[i].set()

    async def _send(i: int, req: SampleRequest) -> None:
        if req.follows is not None:
            await ended[req.follows].wait()  # before taking a slot: the turn before may need one
        if slots is None:
            results[i] = await send(req)
        else:
            async with slots:
                results[i] = await send(req)
        if progress is not None:
            progress.update()

    t0 = time.perf_counter()
    tasks = []
    try:
        for i, (req, offset) in enumerate(zip(requests, offsets)):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    duration = time.perf_counter() - t0
    return [r for r in results if r is not None], duration


async def warm_up(requests: Sequence[SampleRequest], send: Send, num: int, max_concurrency: int | None,
                  progress: Progress | None = None) -> list[RequestResult]:
    """``num`` untimed requests (``requests`` from the start, cycling: `bench.serve.datasets.warm_up_requests`,
    none of them a timed prompt), all at once up to ``max_concurrency``; their results are not part of the
    benchmark."""
    if num <= 0 or not requests:
        return []
    # Independent of each other: a warm-up request waits for no turn before it.
    picked = [requests[i % len(requests)] for i in range(num)]
    picked = [q if q.follows is None else replace(q, follows=None) for q in picked]
    results, _ = await run_load(picked, send, max_concurrency=max_concurrency, progress=progress)
    return results
