"""Per-request ``asyncio.Queue`` s on a replica's event loop, fed from another thread.

The worker thread (`deployments.worker_thread`), or the reader of an engine process
(`deployments.engine_process`), hands each request's items to its queue. A whole round's items go
with one ``call_soon_threadsafe`` per event loop: one each (a write to the loop's self-pipe and a
callback) made the feeding thread and the event loop contend for the GIL once per request per step.
Items keep their order per key; items for a closed stream are dropped (the request is gone).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


class StreamTable:
    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()

    def open(self, key: str) -> asyncio.Queue:
        """``key``'s queue, on the running event loop (call there)."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if key in self._streams:
                raise ValueError(f"request id {key!r} is already in flight")
            self._streams[key] = (asyncio.get_running_loop(), q)
        return q

    def close(self, key: str) -> None:
        with self._lock:
            self._streams.pop(key, None)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def deliver(self, items: list[tuple[str, Any]]) -> None:
        """Put each ``(key, item)`` on its stream, from any thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for key, item in items:
                entry = self._streams.get(key)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop closed (replica shutting down)
                pass
