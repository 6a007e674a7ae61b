"""Prefill side: push a request's finished pages to the decode replica's reserved pages.

Push, never pull: on the H100 a NIXL READ between two processes ran ~2000x
slower than a WRITE (UCX falls back to TCP for cuda_ipc GET), so the side
that owns the data issues WRITEs.

Life of a request (every `begin` yields exactly one `PushResult`, from
`poll`, `abort` or `peer_lost`; the caller frees ``result.pages`` then,
whatever the status):

    pusher.begin(rid, decode_agent, prompt_len, my_pages, decode_pages, deadline_s)
    for each prefill chunk:  pusher.push(rid, tokens_done)   # WRITE of the newly final pages
    ... pusher.poll() -> [PushResult(rid, DONE | FAILED | EXPIRED | CANCELLED, ...)]

Each chunk is one WRITE over every selected region whose notification
(`messages.ChunkDone`) reaches decode after the chunk's bytes; the last one
carries the chunk count and page count. A chunk's WRITE is one descriptor
per region and page run (`TransferPlan`), or for fragmented pages indices
into the descriptor lists the agent prepared at start and at handshake
(`IndexPlan`): numpy arithmetic per chunk, never a Python loop per
descriptor. `begin` already creates the WRITE of the whole request, so a
prompt that fits one prefill chunk is only posted once computed.

A request fails alone: a WRITE error, its deadline, a cancel from decode, a
lost peer, or its peer leaving the `PeerBook` (forgotten, or superseded by a
restart) end that request, tell decode (best effort) and hand its pages back.

Decode re-uses its pages only once this side says none of the request's
WRITEs can land any more (`transfer.receiver`): a WRITE already handed to
the transport cannot be called back (releasing its handle asks NIXL to
cancel it, but bytes on the wire still land). So an ended request's WRITEs
still in flight are kept and polled ("draining"), and the message to decode
is sent only once each of them completed or failed: `PushAborted` for an end
of this side, `PushSettled` for decode's own cancel. A cancel for a request
this agent does not have (never began, already done) is answered at once,
and the id is remembered: `begin` of it is then refused
(`RequestCancelledError`), since decode may already have re-used the pages.
The prefill pages themselves go back to the caller at once: a WRITE still
reading them after they are re-used can only carry garbage into the dead
request's pages, which decode holds.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from attention.formats import pages_for_tokens
from transfer.agent import TransferAgent, Xfer
from transfer.errors import PlanError, RequestCancelledError
from transfer.handshake import Peer, PeerBook
from transfer.messages import ChunkDone, Message, PushAborted, PushCancelled, PushSettled, WarmUp, encode
from transfer.plan import PageRuns, RegionSelection, descriptor_plan, finished_pages, index_plan

log = logging.getLogger(__name__)


class PushStatus(str, enum.Enum):
    DONE = "done"
    FAILED = "failed"
    """A WRITE or notification errored (peer died, NIXL error) or the caller aborted."""
    EXPIRED = "expired"
    """The deadline passed before every chunk was pushed and completed."""
    CANCELLED = "cancelled"
    """Decode gave up on the request (its deadline, client disconnect)."""


@dataclass(frozen=True)
class PushResult:
    """Outcome of one pushed request. ``pages``: the local (prefill) pages, now the caller's to free."""

    request_id: str
    status: PushStatus
    pages: tuple[int, ...]
    chunks: int
    nbytes: int
    seconds: float
    reason: str = ""
    tail_seconds: float = 0.0
    """From posting the last chunk to the end (0 if it was never posted): the part of the transfer
    after the prompt's last forward, which the first token waits for."""

    @property
    def ok(self) -> bool:
        return self.status is PushStatus.DONE


@dataclass
class PushStats:
    """Where posting time went, summed over every WRITE a `Pusher` posted (a warm-up included).

    ``plan_s``: computing the plans (indices, or descriptors when not
    prepared); ``make_s``: creating the NIXL requests; ``post_s``: inside
    NIXL's ``transfer`` (the backend issuing the descriptors).
    """

    writes: int = 0
    descriptors: int = 0
    nbytes: int = 0
    plan_s: float = 0.0
    make_s: float = 0.0
    post_s: float = 0.0

    def copy(self) -> "PushStats":
        return PushStats(**vars(self))

    def since(self, before: "PushStats") -> "PushStats":
        return PushStats(**{k: v - getattr(before, k) for k, v in vars(self).items()})


@dataclass
class _RequestPush:
    request_id: str
    peer: Peer
    prompt_len: int
    local_pages: np.ndarray
    remote_pages: np.ndarray
    started: float
    deadline: float
    sent_pages: int = 0
    chunks: int = 0
    """Chunks pushed (the next one's index)."""
    posted: int = 0
    """Chunks posted: their WRITEs (or the notification of an empty one) handed to NIXL."""
    last_pushed: bool = False
    """The last chunk was pushed (its WRITE may still wait for the device, `waiting`)."""
    nbytes: int = 0
    inflight: list[Xfer] = field(default_factory=list)
    ready: Optional[Xfer] = None
    """The whole request's WRITE, created at `begin` and posted if one chunk turns out to carry
    every page (a prompt within one prefill chunk); released unposted otherwise."""
    ready_notif: bytes = b""
    """``ready``'s notification (the one-chunk `ChunkDone`), encoded at `begin` as well."""
    last_posted_at: Optional[float] = None
    waiting: list["_Chunk"] = field(default_factory=list)
    """Pushed chunks whose pages the device is still writing, in push order (see `Pusher`'s ``fence``)."""


@dataclass
class _Chunk:
    """A pushed chunk: pages ``[lo, hi)`` of its request; ``written`` (from the fence) says when the
    device has written them (None: already)."""

    index: int
    lo: int
    hi: int
    last: bool
    written: Optional[Callable[[], bool]] = None


@dataclass
class _Drain:
    """An ended request's WRITEs still in flight; ``message`` goes to ``peer_agent`` once none is."""

    request_id: str
    peer_agent: str
    xfers: list[Xfer]
    message: Message
    since: float
    warned: bool = False


PATHS = ("auto", "prepared", "explicit")
"""`Pusher` paths: how a WRITE names its bytes (see `Pusher`)."""

EXPLICIT_MAX_DESCRIPTORS = 4096
"""`Pusher` path "auto": the most descriptors a chunk is posted with explicitly."""

DRAIN_WARN_S = 10.0
"""A drain this old is logged once: decode holds the request's pages until it ends."""


class Pusher:
    """Pushes requests from this agent to decode peers. Drive from one thread.

    ``merge``: merge descriptors contiguous on both sides (False only for
    benchmarks). ``path``: how a WRITE names its bytes: ``"prepared"``
    (indices into the descriptor lists prepared at start and handshake,
    `IndexPlan`), ``"explicit"`` (one descriptor per region and page run,
    `TransferPlan`, through ``initialize_xfer``), or ``"auto"`` (the default:
    explicit while a chunk needs at most `EXPLICIT_MAX_DESCRIPTORS`, else
    prepared). ``layers`` / ``kinds``: restrict the regions pushed (None =
    all registered). ``run_pages``: the most pages one descriptor covers
    (None: a whole run; longer runs are cut, `PageRuns.split`, so that one
    WRITE's copies spread over NIXL's posting threads and their streams).
    ``fence``: called when `push` is given new pages; returns a check that
    turns True once the device has written them. A CUDA cache needs one:
    NIXL copies on UCX's own CUDA stream, which does not wait for the
    kernels that wrote the pages (`workers.kv_link.device_fence` records a
    CUDA event). A chunk's WRITE is posted once its check passes, in push
    order, by `push` itself or a later `poll`: the caller never waits for
    the device, and can queue its next forward meanwhile. A caller that
    has waited for the device since (``push(..., written=True)``) skips it.
    ``clock``: seconds, monotonic (tests may inject one).
    ``remember_cancelled``: how many cancelled request ids are kept to refuse
    a late `begin`.
    """

    def __init__(
        self,
        agent: TransferAgent,
        peers: PeerBook,
        *,
        merge: bool = True,
        path: str = "auto",
        layers: Optional[Iterable[int]] = None,
        kinds: Optional[Iterable[str]] = None,
        run_pages: Optional[int] = None,
        fence: Optional[Callable[[], Callable[[], bool]]] = None,
        clock: Callable[[], float] = time.monotonic,
        remember_cancelled: int = 65536,
    ):
        self.agent = agent
        self.peers = peers
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if run_pages is not None and run_pages < 1:
            raise ValueError(f"run_pages must be >= 1 or None, got {run_pages!r}")
        self.merge = merge
        self.path = path
        self.run_pages = run_pages
        self.fence = fence
        self.stats = PushStats()
        self._selections: dict[str, RegionSelection] = {}  # per peer agent, dropped with the peer
        self.layers = None if layers is None else tuple(layers)
        self.kinds = None if kinds is None else tuple(kinds)
        self.clock = clock
        self._jobs: dict[str, _RequestPush] = {}
        self._results: list[PushResult] = []
        self._unreleased: list[Xfer] = []  # handles NIXL refused to release (still in flight)
        self._draining: list[_Drain] = []
        self._cancelled: OrderedDict[tuple[str, str], None] = OrderedDict()  # (decode agent, request id)
        self._remember_cancelled = remember_cancelled

    @property
    def active(self) -> list[str]:
        return list(self._jobs)

    @property
    def draining(self) -> list[str]:
        """Ended requests whose WRITEs are still in flight (decode is told once they are not)."""
        return [d.request_id for d in self._draining]

    def writes_in_flight(self) -> int:
        """WRITEs posted and not yet completed (or failed), over all requests, ended ones included."""
        xfers = [x for j in self._jobs.values() for x in j.inflight] + [x for d in self._draining for x in d.xfers]
        return sum(self.agent.state(x) == "PROC" for x in xfers)

    def has_work(self) -> bool:
        """Something for `poll`: a request, a drain, or a cancel from decode waiting for its answer."""
        return bool(self._jobs or self._draining) or self.agent.has(PushCancelled)

    def begin(
        self,
        request_id: str,
        peer_agent: str,
        prompt_len: int,
        local_pages: Sequence[int],
        remote_pages: Sequence[int],
        deadline_s: float,
        prepare: bool = True,
    ) -> None:
        """Start tracking a request; nothing is sent until `push`.

        ``prepare``: create the WRITE of the whole request now (off the
        critical path), to be posted if one chunk carries every page; pass
        False when the prompt will surely be pushed in several chunks.

        Both page lists must hold ``pages_for_tokens(prompt_len)`` ids (the
        shared helper decode used to reserve them). Raises `UnknownPeerError`
        if ``peer_agent`` (that exact epoch) was not handshaked, `PlanError`
        on bad pages; on a raise the request is not tracked.
        """
        if request_id in self._jobs:
            raise ValueError(f"request {request_id!r} is already being pushed")
        # Its cancel may be queued but not read yet: read it before deciding.
        self._take_cancels()
        if (peer_agent, request_id) in self._cancelled:
            raise RequestCancelledError(f"request {request_id!r} was cancelled by {peer_agent} before it began")
        n = pages_for_tokens(prompt_len)
        if len(local_pages) != n or len(remote_pages) != n:
            raise PlanError(
                f"request {request_id!r}: prompt of {prompt_len} tokens needs {n} pages, got "
                f"{len(local_pages)} local and {len(remote_pages)} remote"
            )
        peer = self.peers.get(peer_agent)
        # Validate the whole request now so a bad page list fails before any byte moves.
        lp, rp = self._selection(peer).check(local_pages, remote_pages)
        now = self.clock()
        job = _RequestPush(request_id, peer, prompt_len, lp, rp, now, now + deadline_s)
        if n and prepare:
            try:
                # Off the critical path: begin runs when decode has reserved the pages, before
                # prefill computes them; the push then only posts.
                job.ready = self._prepare(peer, lp, rp)
                job.ready_notif = encode(self._chunk_done(job, 0, True))
            except Exception as e:  # noqa: BLE001 - push builds its WRITE then (and fails there if it must)
                log.debug("preparing the WRITE of %s: %s", request_id, e)
        self._jobs[request_id] = job

    def push(self, request_id: str, tokens_done: int, written: bool = False) -> bool:
        """Push the pages that became final now that ``tokens_done`` prompt tokens are in the cache.

        ``tokens_done == prompt_len`` pushes the rest (the partial last page
        included) and marks the last chunk. ``written``: the caller has waited
        for the device since the kernels that wrote these pages were queued
        (it read a result of the same stream back), so the WRITE needs no
        ``fence``. Returns False if the request is not (or no longer) active,
        e.g. it already failed; transport errors never raise here, they end
        the request (see `poll`).
        """
        job = self._jobs.get(request_id)
        if job is None or job.last_pushed:
            return False
        upto = finished_pages(tokens_done, job.prompt_len)
        last = tokens_done == job.prompt_len
        if upto < job.sent_pages:
            raise ValueError(f"request {request_id!r}: tokens_done went backwards ({upto} < {job.sent_pages} pages)")
        if upto == job.sent_pages and not last:
            return True  # the chunk finished no page
        fenced = self.fence is not None and not written and upto > job.sent_pages
        written_yet = self.fence() if fenced else None
        job.waiting.append(_Chunk(job.chunks, job.sent_pages, upto, last, written_yet))
        job.sent_pages = upto
        job.chunks += 1
        job.last_pushed = last
        return self._post_ready(job)

    def poll(self, spin_s: float = 0.0) -> list[PushResult]:
        """Advance every request; returns the requests that ended since the last call.

        ``spin_s``: a caller with nothing else to do first checks the WRITEs
        in flight in a tight loop, for up to this long, until one ends. A
        request's completion is then seen (and decode notified: NIXL sends
        the notification from this check) within microseconds of its copies,
        not a bookkeeping pass or a sleep later.
        """
        if spin_s > 0:
            self._spin(spin_s)
        self._take_cancels()
        now = self.clock()
        for name in [n for n in self._selections if not self.peers.knows(n)]:
            del self._selections[name]  # the peer was forgotten or superseded
        for job in list(self._jobs.values()):
            if not self._post_ready(job):
                continue  # its peer is gone, or a post failed: the request ended
            states = [self.agent.state(x) for x in job.inflight]
            if "ERR" in states:
                self._results.append(self._finish(job, PushStatus.FAILED, "WRITE failed", tell_peer=True))
                continue
            for x in [x for x, s in zip(job.inflight, states) if s == "DONE"]:
                self.agent.release(x)
                job.inflight.remove(x)
            if job.last_pushed and not job.inflight and not job.waiting:
                self._results.append(self._finish(job, PushStatus.DONE, "", tell_peer=False))
            elif now > job.deadline:
                reason = f"deadline of {job.deadline - job.started:.3f}s passed after {job.posted} chunk(s)"
                self._results.append(self._finish(job, PushStatus.EXPIRED, reason, tell_peer=True))
        self._advance_drains(now)
        self._unreleased = [x for x in self._unreleased if not self._try_release(x)]
        out, self._results = self._results, []
        return out

    def abort(self, request_id: str, reason: str) -> Optional[PushResult]:
        """End a request now (prefill failed, shutdown); decode is told once its WRITEs ended. None if not active."""
        job = self._jobs.get(request_id)
        if job is None:
            return None
        return self._finish(job, PushStatus.FAILED, reason, tell_peer=True)

    def peer_lost(self, peer_agent: str, reason: str = "peer lost") -> list[PushResult]:
        """End every request pushing to ``peer_agent`` (it died); the peer is not contacted."""
        jobs = [j for j in self._jobs.values() if j.peer.agent_name == peer_agent]
        out = [self._finish(j, PushStatus.FAILED, reason, tell_peer=False) for j in jobs]
        for d in [d for d in self._draining if d.peer_agent == peer_agent]:
            self._draining.remove(d)
            self._release_all(d.xfers)
        return out

    def warm_up(
        self,
        peer_agent: str,
        local_page: int = 0,
        remote_page: int = 0,
        timeout_s: float = 60.0,
        repeat: int = 32,
        notify: bool = True,
        rounds: int = 3,
    ) -> float:
        """Connect to a peer and WRITE one page of every region ``repeat`` times; returns the seconds it took.

        The first transfer of a new pair is slow (connection setup, remote
        memory mapping per region, the transport growing its request and
        event pools to the number of descriptors in flight): pay it at
        start, not on a user's first request. Writing the same page
        ``repeat`` times in one WRITE (unmergeable: ``regions x repeat``
        descriptors) sizes those pools like a real request without touching
        any other page. ``remote_page`` must be a page no request is using
        (e.g. before serving starts, or one reserved for this by the peer).
        ``notify``: attach a `messages.WarmUp` notification (dropped by the
        peer), so the notification path is warmed as well. ``rounds``: how
        many such WRITEs, one after the other (on two H200s the first request
        came within 0.01-0.03 of a warm one after 3, 0.04-0.07 after 1; docs/perf.md).
        Each round then WRITEs the page once (one descriptor per region, the
        fewest a WRITE has): an agent with posting threads spreads a WRITE of
        at least ``split_batch_size`` descriptors over their UCX workers but
        posts a smaller one on the calling thread's own worker, which must be
        warm too.
        """
        if repeat < 1 or rounds < 1:
            raise ValueError(f"repeat and rounds must be >= 1, got {repeat}, {rounds}")
        peer = self.peers.get(peer_agent)
        self._selection(peer).check([local_page], [remote_page])
        t0 = self.clock()
        self.agent.connect(peer.agent_name)
        for n in ([repeat, 1] if repeat > 1 else [1]) * rounds:
            pages = np.full(n, local_page, dtype=np.int64), np.full(n, remote_page, dtype=np.int64)
            xfer = self._write(peer, *pages, encode(WarmUp()) if notify else b"")
            try:
                while self.agent.state(xfer) == "PROC":
                    if self.clock() - t0 > timeout_s:
                        raise TimeoutError(f"warm-up WRITE to {peer_agent} took over {timeout_s}s")
                if xfer.state != "DONE":
                    raise RuntimeError(f"warm-up WRITE to {peer_agent} failed")
            finally:
                if not self.agent.release(xfer):
                    self._unreleased.append(xfer)
        return self.clock() - t0

    # -- internals ----------------------------------------------------------

    def _spin(self, spin_s: float) -> None:
        end = time.perf_counter() + spin_s  # real time, whatever ``clock`` a test injects
        state = self.agent.state
        while True:
            for job in [j for j in self._jobs.values() if j.waiting]:
                self._post_ready(job)
            xfers = [x for j in self._jobs.values() for x in j.inflight]
            waiting = any(j.waiting for j in self._jobs.values())
            if self._results or not (xfers or waiting) or any(state(x) != "PROC" for x in xfers):
                return
            if time.perf_counter() >= end:
                return
            time.sleep(0)  # releases the GIL: a replica's event loop keeps serving meanwhile

    def _ended_by_gone_peer(self, job: _RequestPush) -> bool:
        """End ``job`` (FAILED) if its peer left the book: forgotten, or superseded by a newer
        epoch of the same worker, whose pages are gone with the old process. True if it did."""
        if self.peers.knows(job.peer.agent_name):
            return False
        reason = f"peer {job.peer.agent_name} forgotten or restarted"
        self._results.append(self._finish(job, PushStatus.FAILED, reason, tell_peer=False))
        return True

    def _post_ready(self, job: _RequestPush) -> bool:
        """End ``job`` if its peer is gone (nothing is posted to a gone peer); else post its waiting
        chunks whose pages are written, in order. False if the request ended (gone peer, failed post)."""
        if self._ended_by_gone_peer(job):
            return False
        while job.waiting and (job.waiting[0].written is None or job.waiting[0].written()):
            chunk = job.waiting.pop(0)
            try:
                self._post_chunk(job, chunk)
            except Exception as e:  # noqa: BLE001 - any transport error fails this request only
                reason = f"posting chunk {chunk.index}: {e}"
                self._results.append(self._finish(job, PushStatus.FAILED, reason, tell_peer=True))
                return False
        return True

    def _post_chunk(self, job: _RequestPush, chunk: _Chunk) -> None:
        if chunk.hi > chunk.lo:
            whole = chunk.lo == 0 and chunk.hi == len(job.local_pages)
            if whole and job.ready is not None:
                xfer, job.ready = job.ready, None
                self._post(xfer, job.ready_notif)
            else:
                self._drop_ready(job)  # a partial chunk: the whole request's WRITE is not the one
                msg = encode(self._chunk_done(job, chunk.index, chunk.last))
                xfer = self._write(job.peer, job.local_pages[chunk.lo : chunk.hi],
                                   job.remote_pages[chunk.lo : chunk.hi], msg)
            job.inflight.append(xfer)
            job.nbytes += xfer.nbytes
        else:
            # A last chunk without pages (only an empty prompt has one):
            # the count still has to reach decode.
            self.agent.notify(job.peer.agent_name, self._chunk_done(job, chunk.index, chunk.last))
        job.posted += 1
        if chunk.last:
            job.last_posted_at = self.clock()

    @staticmethod
    def _chunk_done(job: _RequestPush, index: int, last: bool) -> ChunkDone:
        return ChunkDone(job.request_id, index, count=index + 1 if last else None,
                         pages=len(job.local_pages) if last else None)

    def _selection(self, peer: Peer) -> RegionSelection:
        """The regions pushed to ``peer`` as flat-index offsets: computed once per peer (epoch)."""
        sel = self._selections.get(peer.agent_name)
        if sel is None or sel.remote is not peer.regions:
            sel = RegionSelection.of(self.agent.table, peer.regions, self.layers, self.kinds)
            self._selections[peer.agent_name] = sel
        return sel

    def _plan(self, peer: Peer, local_pages: np.ndarray, remote_pages: np.ndarray):
        """The WRITE of these (validated) pages per ``path``; its time counts as ``stats.plan_s``."""
        t0 = time.perf_counter()
        sel = self._selection(peer)
        runs = PageRuns.of(local_pages, remote_pages, self.merge)
        pieces = runs.split(self.run_pages)  # prepared lists are merged by NIXL, never cut
        if self.path == "explicit" or (self.path == "auto" and len(pieces) * len(sel.keys) <= EXPLICIT_MAX_DESCRIPTORS):
            plan = descriptor_plan(sel, pieces)
        else:
            plan = index_plan(sel, local_pages, remote_pages, merge=self.merge, runs=runs)
        self.stats.plan_s += time.perf_counter() - t0
        return plan

    def _prepare(self, peer: Peer, local_pages: np.ndarray, remote_pages: np.ndarray) -> Xfer:
        """Plan (validated pages; duplicates allowed only for the warm-up) and create one WRITE."""
        xfer = self.agent.prepare(peer.agent_name, self._plan(peer, local_pages, remote_pages))
        self.stats.make_s += xfer.make_s
        return xfer

    def _write(self, peer: Peer, local_pages: np.ndarray, remote_pages: np.ndarray, notif: bytes) -> Xfer:
        """`_prepare` and `_post` one WRITE."""
        xfer = self._prepare(peer, local_pages, remote_pages)
        self._post(xfer, notif)
        return xfer

    def _post(self, xfer: Xfer, notif: bytes) -> None:
        """Post a prepared WRITE (released if NIXL refuses it)."""
        try:
            self.agent.post(xfer, notif)
        except Exception:
            self._release_all([xfer])
            raise
        st = self.stats
        st.writes += 1
        st.descriptors += xfer.descriptors
        st.nbytes += xfer.nbytes
        st.post_s += xfer.post_s

    def _drop_ready(self, job: _RequestPush) -> None:
        if job.ready is not None:
            self._release_all([job.ready])
            job.ready = None

    def _try_release(self, x: Xfer) -> bool:
        return self.agent.state(x) != "PROC" and self.agent.release(x)

    def _release_all(self, xfers: list[Xfer]) -> None:
        for x in xfers:
            # Releasing an in-flight handle asks NIXL to cancel it; if it
            # refuses, keep the handle and retry later (not to leak it).
            if not self.agent.release(x):
                self._unreleased.append(x)

    def _send(self, peer_agent: str, msg: Message) -> None:
        try:
            self.agent.notify(peer_agent, msg)
        except Exception as e:  # noqa: BLE001 - the peer may be the thing that died
            log.debug("%s to %s: %s", type(msg).__name__, peer_agent, e)

    def _take_cancels(self) -> None:
        """Act on decode's cancels: end the request (answered once drained) or answer at once."""
        for sender, msg in self.agent.take(PushCancelled):
            if not self.peers.knows(sender):
                continue  # a dead or unknown epoch: nothing of ours goes there, and it cannot be told
            rid = msg.request_id
            self._cancelled[(sender, rid)] = None
            while len(self._cancelled) > self._remember_cancelled:
                self._cancelled.popitem(last=False)
            job = self._jobs.get(rid)
            if job is not None and job.peer.agent_name == sender:
                self._results.append(self._finish(job, PushStatus.CANCELLED, f"decode: {msg.reason}", tell_peer=True))
            elif not any(d.request_id == rid and d.peer_agent == sender for d in self._draining):
                # Never began, already done, or pushing to another agent:
                # nothing of this request is in flight to ``sender``.
                self._send(sender, PushSettled(rid, "no write in flight"))
            # else: its drain ends with a message that settles it.

    def _advance_drains(self, now: float) -> None:
        keep = []
        for d in self._draining:
            if not self.peers.knows(d.peer_agent):
                self._release_all(d.xfers)  # the peer is gone: nobody to tell, nothing to protect
                continue
            if any(self.agent.state(x) == "PROC" for x in d.xfers):
                if not d.warned and now - d.since > DRAIN_WARN_S:
                    d.warned = True
                    log.warning("push of %s to %s: WRITEs still in flight %.0fs after it ended; decode holds "
                                "its pages until they end", d.request_id, d.peer_agent, now - d.since)
                keep.append(d)
                continue
            self._release_all(d.xfers)
            self._send(d.peer_agent, d.message)
        self._draining = keep

    def _finish(self, job: _RequestPush, status: PushStatus, reason: str, *, tell_peer: bool) -> PushResult:
        """End ``job``; ``tell_peer``: decode is told (PushSettled for a cancel, else PushAborted) once drained."""
        del self._jobs[job.request_id]
        self._drop_ready(job)
        xfers, job.inflight = job.inflight, []
        if tell_peer:
            msg: Message = (PushSettled(job.request_id, reason) if status is PushStatus.CANCELLED
                            else PushAborted(job.request_id, reason))
            if any(self.agent.state(x) == "PROC" for x in xfers):
                self._draining.append(_Drain(job.request_id, job.peer.agent_name, xfers, msg, self.clock()))
            else:
                self._release_all(xfers)
                self._send(job.peer.agent_name, msg)
        else:
            self._release_all(xfers)  # DONE (nothing in flight) or the peer is gone
        if status is not PushStatus.DONE:
            log.warning("push of %s to %s %s: %s", job.request_id, job.peer.agent_name, status.value, reason)
        now = self.clock()
        return PushResult(
            request_id=job.request_id,
            status=status,
            pages=tuple(job.local_pages.tolist()),
            chunks=job.posted,
            nbytes=job.nbytes,
            seconds=now - job.started,
            reason=reason,
            tail_seconds=0.0 if job.last_posted_at is None else now - job.last_posted_at,
        )
