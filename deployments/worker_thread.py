"""A replica's worker thread: the one thread that touches its worker.

The workers (``PrefillWorker``, ``DecodeWorker``) and their NIXL agent are
synchronous and not thread-safe, while a Serve replica serves requests on an
asyncio event loop. So each replica runs one background thread that owns its
worker: the event loop sends it commands through a thread-safe queue
(`post`, `call`), the thread steps the worker whenever it has work, and
per-request results go back to per-request ``asyncio.Queue`` s through
``loop.call_soon_threadsafe`` (`open_stream` / `emit`).

A subclass implements `has_work`, `tick` (one round of the worker) and
`snapshot` (the load figures the router and ``/stats`` read). If a tick
raises, the worker's state can no longer be trusted: every open stream gets
the error, the thread stops, and `check` raises so Serve's health check
replaces the replica.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable

from deployments.metrics import hop_trace
from deployments.replica_stats import ReplicaStats, StepRecord, take_records
from deployments.stream_table import StreamTable
from workers.request import unavailable

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console


ENGINE_FAILED = "engine failed"
"""How the error of a request ended by its replica's failed engine starts, after `unavailable`'s prefix (a fault
of the replica, not of the request: 503 at the ingress, and a PD attempt decode retries once)."""


class WorkerThreadFailed(RuntimeError):
    """The worker thread died; the replica must be replaced."""


class WorkerThread:
    engine_pid: int | None = None
    """The pid of a process of its own running the worker (`deployments.engine_process`); None: this one."""
    IDLE_POLL_S = 0.1
    """How long an idle thread blocks on its queue before re-checking for shutdown."""
    MAX_STEP_RECORDS = 10_000
    """Step records kept for the metrics between heartbeats (the oldest drop if the event loop stalls)."""
    WAIT_SLEEP_S = 0.0005
    """Pause between ticks that only polled the network (waiting for KV or WRITE
    completions): a tight loop would take a core from the model on a small host.
    It adds to a request's time to first token on both sides of a push, so it
    stays well under a push's copy time (docs/perf.md, "Tuning choices and their
    measurements")."""

    EMITTED_POINT = "engine.emitted"
    """The hop-trace point of a request's first output with tokens leaving this thread
    (`deployments.metrics.hop_trace`)."""

    def __init__(self, name: str):
        self.name = name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams = StreamTable()
        self._deliver: Callable[[list[tuple[str, Any]]], None] = self._streams.deliver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None
        self.stats: ReplicaStats | None = None
        """Latest `snapshot` (frozen), replaced whole after every round; set by `start`."""
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=self.MAX_STEP_RECORDS)
        """Steps that computed, appended by `tick`, taken by the replica's metrics (`take_steps`)."""

    # ------------------------------------------------------------ asyncio side
    def start(self) -> None:
        self.stats = self.snapshot()
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the thread to end (after a failure: its `fail_all` is then done)."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def check(self) -> None:
        """Raise `WorkerThreadFailed` if the thread died (Serve's health check calls this)."""
        if self.error is not None:
            raise WorkerThreadFailed(f"{self.name} worker thread failed: {self.error!r}") from self.error
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise WorkerThreadFailed(f"{self.name} worker thread exited")

    def take_steps(self) -> list[StepRecord]:
        """The step records appended since the last call."""
        return take_records(self.steps)

    def post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the worker thread; errors are logged, not returned."""
        self._commands.put((fn, args, None))

    def call(self, fn: Callable, *args) -> asyncio.Future:
        """Run ``fn(*args)`` on the worker thread; await the returned future for its result.

        Cancelling the future before the thread picks the command up skips it.
        """
        return asyncio.wrap_future(self.call_future(fn, *args))

    def call_future(self, fn: Callable, *args) -> concurrent.futures.Future:
        """`call` from any thread: the future of ``fn(*args)`` run on the worker thread."""
        cf: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, cf))
        return cf

    def handshake_offer(self) -> bytes | None:
        """The NIXL handshake offer of the worker's link (None without one: monolithic decode). Before
        `start`: nothing else uses the agent yet."""
        link = self.worker.link
        return link.peers.offer().to_bytes() if link is not None else None

    def open_stream(self, key: str) -> asyncio.Queue:
        """A queue receiving what the thread `emit` s for ``key`` (call on the event loop)."""
        return self._streams.open(key)

    def close_stream(self, key: str) -> None:
        self._streams.close(key)

    # -------------------------------------------------------------- thread side
    def emit(self, key: str, item: Any) -> None:
        """Hand ``item`` to ``key``'s stream (dropped if the stream was closed: the request is gone)."""
        self.emit_many([(key, item)])

    def emit_many(self, items: list[tuple[str, Any]]) -> None:
        """`emit` for a whole round's items with one wake-up of each event loop (`StreamTable.deliver`)."""
        if items:
            if hop_trace.active():
                for key, item in items:
                    if hop_trace.carries_tokens(item):
                        hop_trace.mark(key, self.EMITTED_POINT)
            self._deliver(items)

    def redirect_outputs(self, deliver: Callable[[list[tuple[str, Any]]], None]) -> None:
        """Hand every round's ``(key, item)`` s to ``deliver`` instead of this process's streams (an engine
        process sends them to its replica: `deployments.engine_process`). Before `start`."""
        self._deliver = deliver

    def has_work(self) -> bool:
        raise NotImplementedError

    def tick(self) -> bool:
        """One round of the worker; True if it computed (False: it only polled)."""
        raise NotImplementedError

    def snapshot(self) -> ReplicaStats:
        raise NotImplementedError

    def fail_all(self, message: str) -> None:
        """Tell every open stream the engine failed (subclasses send their error item)."""

    def _run_command(self, fn, args, cf) -> None:
        if cf is not None and not cf.set_running_or_notify_cancel():
            return  # its caller gave up before it ran
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - a command's error belongs to its caller
            if cf is not None:
                cf.set_exception(e)
            else:
                log.exception("%s: command %s failed", self.name, getattr(fn, "__name__", fn))
            return
        if cf is not None:
            cf.set_result(result)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self.IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.has_work())
                if self.has_work():
                    if not self.tick():
                        time.sleep(self.WAIT_SLEEP_S)
                self.stats = self.snapshot()
        except BaseException as e:  # noqa: BLE001 - the replica must learn that its engine is gone
            log.exception("%s worker thread failed", self.name)
            self.error = e
            self.fail_all(unavailable(f"{ENGINE_FAILED}: {e!r}"))
