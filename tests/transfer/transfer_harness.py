"""Two-process harness for the NIXL transfer tests.

Each `WorkerProc` is a real spawned process owning a `Worker`: random cache
regions, a NIXL agent (UCX over DRAM, loopback only), a peer book, a pusher,
a receiver and a `PagePool` free-list. The test process scripts both sides
over pipes; each command is ``(method, args, kwargs)`` answered by
``("ok", value)`` or ``("err", (type name, message))``. Every wait is bounded
by a timeout, and each child exits on its own after `CHILD_LIFETIME_S`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

CHILD_LIFETIME_S = 300.0


def _context():
    """Fork children from a server that imported torch once (spawning re-imports it per child:
    seconds each on a 2-core CI box). NIXL is only imported in the child, after the fork."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy"])
    return ctx


@dataclass(frozen=True)
class Geometry:
    """Caches of the test model: per layer MLA and index pages, plus a state kind on some layers.

    Real DeepSeek-V3.2 page sizes (41,984 B MLA, 8,448 B index), 4 layers + MTP,
    and a V4-like ``"swa"`` state cache on layers 0 and 1.
    """

    num_layers: int = 5
    mla_bytes: int = 41_984
    index_bytes: int = 8_448
    state_kind: str = "swa"
    state_bytes: int = 4_096
    state_layers: tuple[int, ...] = (0, 1)
    model: str = "test/dsv32-tiny"
    has_mtp: bool = True

    def kinds(self) -> list[tuple[int, str, int]]:
        out = []
        for layer in range(self.num_layers):
            out.append((layer, "mla", self.mla_bytes))
            out.append((layer, "index", self.index_bytes))
            if layer in self.state_layers:
                out.append((layer, self.state_kind, self.state_bytes))
        return out

    def compat(self):
        from transfer import CompatInfo

        return CompatInfo(
            model=self.model,
            num_layers=self.num_layers,
            page_size=64,
            kv_format="fp8_656",
            index_format="fp8_132",
            has_mtp=self.has_mtp,
            state_formats=((self.state_kind, "test_state"),) if self.state_layers else (),
        )


class PagePool:
    """Free-list of page ids that hands out scattered runs (to exercise merging and its absence)."""

    def __init__(self, num_pages: int, seed: int):
        import random

        self.num_pages = num_pages
        self._free = set(range(num_pages))
        self._rng = random.Random(seed)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked {n} pages, {len(self._free)} free")
        out: list[int] = []
        while len(out) < n:
            p = self._rng.choice(sorted(self._free))
            run = self._rng.randint(1, 4)
            while run and p in self._free and len(out) < n:
                self._free.remove(p)
                out.append(p)
                p, run = p + 1, run - 1
        return out

    def free(self, pages) -> None:
        for p in pages:
            if p in self._free or not 0 <= p < self.num_pages:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._free.add(p)


class Worker:
    """One side of a pair, living in a child process."""

    def __init__(self, conn, worker_id: str, geometry: Geometry, num_pages: int, seed: int,
                 progress_thread: bool = True):
        import torch

        from transfer import CacheRegion, PeerBook, Pusher, Receiver, TransferAgent

        self.conn = conn
        gen = torch.Generator().manual_seed(seed)
        self.regions = [
            CacheRegion.of(layer, kind, torch.randint(0, 256, (num_pages, bpp), dtype=torch.uint8, generator=gen))
            for layer, kind, bpp in geometry.kinds()
        ]
        self.agent = TransferAgent(worker_id, self.regions, geometry.compat(), progress_thread=progress_thread)
        self.book = PeerBook(self.agent)
        self.pusher = Pusher(self.agent, self.book)
        self.pool = PagePool(num_pages, seed)
        self.receiver = Receiver(self.agent, self.book, release_pages=self.pool.free)
        self._local: dict[str, list[int]] = {}  # prefill pages of requests begun with `begin_push`

    # -- identity / handshake --------------------------------------------------------

    def name(self) -> str:
        return self.agent.name

    def offer(self) -> bytes:
        return self.book.offer().to_bytes()

    def respond(self, offer: bytes) -> bytes:
        return self.book.respond(offer)

    def accept(self, offer: bytes) -> str:
        return self.book.accept(offer).agent_name

    def knows(self, agent_name: str) -> bool:
        return self.book.knows(agent_name)

    def peer_names(self) -> list[str]:
        return [p.agent_name for p in self.book.peers()]

    # -- state -------------------------------------------------------------------

    def snapshot(self) -> dict[tuple[int, str], bytes]:
        return {(r.layer, r.kind): r.tensor.numpy().tobytes() for r in self.regions}

    def free_count(self) -> int:
        return self.pool.free_count

    def ignored_notifs(self) -> int:
        return self.receiver.ignored_notifs

    # -- decode side -------------------------------------------------------------

    def reserve(self, request_id: str, prefill_agent: str, prompt_len: int, deadline_s: float) -> list[int]:
        from attention.formats import pages_for_tokens

        pages = self.pool.allocate(pages_for_tokens(prompt_len))
        try:
            self.receiver.expect(request_id, prefill_agent, prompt_len, pages, deadline_s)
        except Exception:
            self.pool.free(pages)
            raise
        return pages

    def wait(self, timeout_s: float, until_idle: bool = True) -> list[dict[str, Any]]:
        """Poll the receiver for ``timeout_s`` (or until nothing is pending).

        Pages of failures go back to the pool through the receiver, at once
        or once their writers settled (``held`` says which).
        """
        t_end = time.monotonic() + timeout_s
        out = []
        while time.monotonic() < t_end:
            for r in self.receiver.poll():
                out.append({"request_id": r.request_id, "status": r.status.value, "pages": list(r.pages),
                            "chunks": r.chunks, "reason": r.reason, "held": r.held})
            if until_idle and not self.receiver.active:
                break
            time.sleep(0.001)
        return out

    def held(self) -> dict[str, list[int]]:
        """Ended requests whose pages the receiver keeps out of the pool, with their page ids."""
        return {rid: list(p) for rid, p in self.receiver.held.items()}

    def settle(self, timeout_s: float) -> dict[str, list[int]]:
        """Poll until no pages are held (prefill answered every cancel) or ``timeout_s``; returns what is still held."""
        t_end = time.monotonic() + timeout_s
        while self.receiver.held and time.monotonic() < t_end:
            self.receiver.poll()
            time.sleep(0.001)
        return self.held()

    def peer_lost(self, agent_name: str) -> list[str]:
        """Fail every request expected from a dead peer (the receiver frees their pages); returns their ids."""
        out = self.receiver.peer_lost(agent_name, "peer died")
        self.book.forget(agent_name)
        return [r.request_id for r in out]

    def release(self, pages: list[int]) -> None:
        """Decode finished using pages of a completed request."""
        self.pool.free(pages)

    # -- prefill side --------------------------------------------------------------

    def push(
        self,
        requests: list[tuple[str, str, int, list[int]]],
        chunk_tokens: int,
        deadline_s: float,
        pause_after_chunk: Optional[int] = None,
        timeout_s: float = 20.0,
    ) -> dict[str, dict[str, Any]]:
        """Push ``(request_id, decode_agent, prompt_len, decode_pages)`` requests chunk by chunk, interleaved.

        Chunk boundaries are ``chunk_tokens`` apart (need not be page aligned).
        With ``pause_after_chunk=k``, after posting chunk k of every request the
        worker reports ``("paused", ...)`` to the test and blocks until told
        ``"resume"`` (test kills / deadlines happen meanwhile). Returns per
        request: status, reason, local pages, chunks; pages of every ended
        request are freed into the pool.
        """
        from attention.formats import pages_for_tokens

        local: dict[str, list[int]] = {}
        progress: dict[str, int] = {}
        for rid, peer, prompt_len, remote_pages in requests:
            pages = self.pool.allocate(pages_for_tokens(prompt_len))
            try:
                self.pusher.begin(rid, peer, prompt_len, pages, remote_pages, deadline_s)
            except Exception:
                self.pool.free(pages)
                raise
            local[rid] = pages
            progress[rid] = 0
        lens = {rid: n for rid, _, n, _ in requests}
        results: dict[str, dict[str, Any]] = {}

        def collect() -> None:
            for r in self.pusher.poll():
                self.pool.free(r.pages)
                results[r.request_id] = {"status": r.status.value, "reason": r.reason,
                                         "pages": local[r.request_id], "chunks": r.chunks}

        chunk = 0
        t_end = time.monotonic() + timeout_s
        while len(results) < len(requests) and time.monotonic() < t_end:
            collect()
            for rid in progress:
                if rid not in results and progress[rid] < lens[rid]:
                    progress[rid] = min(progress[rid] + chunk_tokens, lens[rid])
                    self.pusher.push(rid, progress[rid])
            if pause_after_chunk is not None and chunk == pause_after_chunk:
                self._wait_done(lambda: self.pusher.writes_in_flight() == 0, 5.0)
                self.conn.send(("paused", None))
                cmd = self.conn.recv()
                assert cmd == "resume", cmd
                # Give notifications that arrived while paused (cancel from
                # decode) a bounded chance to be seen before pushing on, as a
                # real prefill loop polls every step.
                self._wait_done(lambda: (collect(), len(results) == len(requests))[1], 1.0)
            chunk += 1
            time.sleep(0.001)
        return results

    # Step by step (the test scripts each action; nothing polls in between):

    def begin_push(self, request_id: str, decode_agent: str, prompt_len: int, decode_pages: list[int],
                   deadline_s: float) -> list[int]:
        """Allocate prefill pages and `Pusher.begin`; returns the prefill pages."""
        from attention.formats import pages_for_tokens

        pages = self.pool.allocate(pages_for_tokens(prompt_len))
        try:
            self.pusher.begin(request_id, decode_agent, prompt_len, pages, decode_pages, deadline_s)
        except Exception:
            self.pool.free(pages)
            raise
        self._local[request_id] = pages
        return pages

    def post(self, request_id: str, tokens_done: int, timeout_s: float = 10.0) -> bool:
        """Post the WRITE of the pages final at ``tokens_done`` and wait until it landed, without polling.

        Not polling means cancels from decode stay unread: this is a prefill
        whose WRITE was posted before it learnt decode gave up.
        """
        posted = self.pusher.push(request_id, tokens_done)
        self._wait_done(lambda: self.pusher.writes_in_flight() == 0, timeout_s)
        return posted

    def poll_push(self, timeout_s: float, until_idle: bool = True) -> dict[str, dict[str, Any]]:
        """Poll the pusher (cancels, drains) for ``timeout_s`` or until idle; frees pages of ended requests."""
        t_end = time.monotonic() + timeout_s
        out: dict[str, dict[str, Any]] = {}
        while time.monotonic() < t_end:
            for r in self.pusher.poll():
                self.pool.free(r.pages)
                self._local.pop(r.request_id, None)
                out[r.request_id] = {"status": r.status.value, "reason": r.reason, "pages": list(r.pages),
                                     "chunks": r.chunks}
            if until_idle and not self.pusher.has_work():
                break
            time.sleep(0.001)
        return out

    def _wait_done(self, cond, timeout_s: float) -> None:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end and not cond():
            time.sleep(0.001)

    def notify_chunk(self, decode_agent: str, request_id: str, index: int, count: int, pages: int) -> None:
        """Send a stray `ChunkDone` (a late notification of a dead request)."""
        from transfer.messages import ChunkDone

        self.agent.notify(decode_agent, ChunkDone(request_id, index, count, pages))

    def warm_up(self, decode_agent: str) -> float:
        return self.pusher.warm_up(decode_agent)


def _child_main(conn, kwargs: dict) -> None:
    # Loopback only: UCX must not pick up external interfaces.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    threading.Timer(CHILD_LIFETIME_S, lambda: os._exit(3)).start()
    try:
        worker = Worker(conn, **kwargs)
    except Exception as e:  # noqa: BLE001
        conn.send(("err", (type(e).__name__, str(e))))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args, kw = conn.recv()
        except EOFError:
            os._exit(0)
        if method == "exit":
            conn.send(("ok", None))
            os._exit(0)
        try:
            conn.send(("ok", getattr(worker, method)(*args, **kw)))
        except Exception as e:  # noqa: BLE001
            conn.send(("err", (type(e).__name__, str(e))))


class RemoteError(Exception):
    def __init__(self, type_name: str, message: str):
        self.type_name = type_name
        super().__init__(f"{type_name}: {message}")


@dataclass
class WorkerProc:
    """Parent-side handle of one spawned `Worker`."""

    worker_id: str
    geometry: Geometry = field(default_factory=Geometry)
    num_pages: int = 48
    seed: int = 0
    progress_thread: bool = True  # False: as a GPU prefill agent (workers.push_tuning), progressed by its polls

    def __post_init__(self) -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe()
        kwargs = dict(worker_id=self.worker_id, geometry=self.geometry, num_pages=self.num_pages, seed=self.seed,
                      progress_thread=self.progress_thread)
        self.proc = ctx.Process(target=_child_main, args=(child, kwargs), daemon=True)
        self.proc.start()
        child.close()

    def ready(self, timeout_s: float = 60.0) -> "WorkerProc":
        self._recv(timeout_s)
        return self

    def send(self, method: str, *args, **kw) -> None:
        self.conn.send((method, args, kw))

    def _recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.worker_id}: no reply in {timeout_s}s")
        tag, value = self.conn.recv()
        if tag == "err":
            raise RemoteError(*value)
        return value

    def recv(self, timeout_s: float = 30.0):
        return self._recv(timeout_s)

    def recv_tagged(self, timeout_s: float = 30.0):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.worker_id}: no message in {timeout_s}s")
        return self.conn.recv()

    def call(self, method: str, *args, timeout_s: float = 30.0, **kw):
        self.send(method, *args, **kw)
        return self._recv(timeout_s)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=5)
            except Exception:  # noqa: BLE001
                pass
        self.kill()


def handshake(decode: WorkerProc, prefill: WorkerProc) -> None:
    """Decode initiates: offer -> prefill responds -> decode accepts."""
    reply = prefill.call("respond", decode.call("offer"))
    decode.call("accept", reply)
