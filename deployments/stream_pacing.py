"""How often a decode replica sends each request's new tokens.

Every streamed item costs CPU three times: in the decode replica (Serve
serializes and reports it), in the ingress (it deserializes it and writes an
SSE event) and in the HTTP proxy. Those costs scale with items per second,
not tokens: 128 requests at a 10 ms step are 12,800 items/s, more than one
Python process can handle, and the decode replica's share of it takes the
GIL from the engine thread. Measured on an H100 (docs/perf.md, session 11):
batch-128 served TPOT 116 ms against 10 ms offline, the engine thread idle
most of the time.

`StreamPacer` caps the replica's total: each request waits at least
``active streams / items_per_s`` between its items, and whatever the engine
produced meanwhile goes out as one merged item (`take_ready`). A lone request
is never held back (its interval is one step or less), a request's first
token and its final item are never delayed beyond one interval, and TPOT is
unchanged: only the grouping of tokens into chunks changes, so ITL at high
concurrency grows to the interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import AsyncIterator

from workers.engine import RequestOutput


@dataclass
class StreamPacer:
    """items_per_s: the replica's budget of streamed items per second (0: send every output at once).

    max_interval_s: the longest any request waits between its items, whatever the load."""

    items_per_s: float
    max_interval_s: float = 0.1
    active: int = 0

    def __post_init__(self) -> None:
        if self.items_per_s < 0 or self.max_interval_s <= 0:
            raise ValueError(f"items_per_s must be >= 0 and max_interval_s > 0, got {self.items_per_s}, "
                             f"{self.max_interval_s}")

    def open(self) -> None:
        self.active += 1

    def close(self) -> None:
        self.active = max(0, self.active - 1)

    def interval(self) -> float:
        """Seconds a request waits after sending an item before it sends the next."""
        if self.items_per_s == 0:
            return 0.0
        return min(self.max_interval_s, self.active / self.items_per_s)


def take_ready(stream: asyncio.Queue, out: RequestOutput) -> RequestOutput:
    """``out`` merged with the outputs already queued behind it on ``stream``.

    When the event loop falls behind the engine (many requests, a fast step),
    a request's steps queue up here; sending them as one output costs one
    Ray streaming item and one SSE event instead of one per step, so the
    loop catches up instead of falling further behind.
    """
    while not out.finished and not stream.empty():
        nxt = stream.get_nowait()
        merged = {}
        for f in dataclasses.fields(out):
            a, b = getattr(out, f.name), getattr(nxt, f.name)
            if isinstance(a, list) and isinstance(b, list):
                merged[f.name] = a + b
            else:  # the later value, unless it is absent: the prompt logprobs ride on the first output only
                merged[f.name] = a if f.name == "request_id" or b is None else b
        out = RequestOutput(**merged)
    return out


async def paced_outputs(stream: asyncio.Queue, pacer: StreamPacer,
                        first: RequestOutput | None = None) -> AsyncIterator[RequestOutput]:
    """One request's outputs from ``stream``, merged and spaced by ``pacer``, up to the finished one.
    ``first``: its first output, already taken from ``stream`` by the caller.

    The first output goes at once; after each, the next waits out the pacer's
    interval unless it is the final one (a finish is not held back)."""
    sent_at = None
    while True:
        out, first = (first, None) if first is not None else (await stream.get(), None)
        if sent_at is not None and not out.finished:
            wait = sent_at + pacer.interval() - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        out = take_ready(stream, out)
        yield out
        if out.finished:
            return
        sent_at = time.monotonic()
