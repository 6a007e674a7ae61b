"""Decode side: wait for the pages a prefill peer pushes into this worker's reserved pages.

Life of a request (every `expect` yields exactly one `ReceiveResult`, from
`poll`, `cancel` or `peer_lost`; on DONE the pages hold the prompt's caches
and are the caller's; otherwise the receiver gives them back through its
``release_pages`` callback, at once or once no peer can still write them):

    receiver = Receiver(agent, book, release_pages=pool.free)
    pages = pool.allocate(pages_for_tokens(prompt_len))
    receiver.expect(rid, prefill_agent, prompt_len, pages, deadline_s)   # before asking prefill
    ... receiver.poll() -> [ReceiveResult(rid, DONE | FAILED | EXPIRED | CANCELLED, pages, ...)]

Pages a peer may still write are held, never freed. A WRITE prefill has
already posted lands whenever the transport delivers it, whatever decode
decided meanwhile: if decode freed a request's pages at its deadline and
handed them to another request, a late WRITE of the dead request would
overwrite the new one's KV. So when this side ends a request on its own
(deadline, `cancel`, inconsistent notifications) it tells every peer that may
be writing (`PushCancelled`) and holds the pages until each of them has
answered that nothing of the request is in flight (`PushSettled`, or a
`PushAborted`, which prefill also sends only after its WRITEs ended), or has
left the `PeerBook` (forgotten as dead, or superseded by a new epoch), or was
declared lost (`peer_lost`). The cancel is re-sent every ``resend_cancel_s``
while held, in case it was lost. Ends caused by the peer itself (its
`PushAborted`, its loss) give the pages back at once. Late `ChunkDone` s of a
held request are ignored like any other late notification.

Completion is counted, not ordered: one `ChunkDone` per chunk (each sent by
NIXL after that chunk's bytes landed), the last carrying the chunk count.
Notifications from any agent but the expected one (e.g. a dead epoch of the
same prefill worker) and notifications for requests no longer waiting are
ignored and counted in ``ignored_notifs``.

A request id must not be reused for a new attempt: a late notification of
the old attempt could complete the new one. `expect` refuses ids that ended
recently.

Any-peer waits: ``expect(rid, None, ...)`` accepts the request from whichever
handshaked peer (known to the `PeerBook`, when one is given) notifies about
it first, and binds the wait to that peer from then on (later notifications
from any other agent are ignored, and a bound wait fails when its peer leaves
the book, as a named one does). This serves a decode replica that lets a
load-aware router pick the prefill replica after the pages are reserved: the
wait must exist before prefill can push, but who pushes is known only once
it does. An unbound wait that ends on this side may be pushed by any peer of
the book (the one that got the task may have posted a WRITE whose
notification has not arrived): every one of them is told and must settle
before the pages are released. A peer that never had the request settles at
once and refuses to begin it later (`transfer.RequestCancelledError`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from attention.formats import pages_for_tokens
from transfer.agent import TransferAgent
from transfer.errors import PlanError
from transfer.handshake import PeerBook
from transfer.messages import ChunkDone, PushAborted, PushCancelled, PushSettled

log = logging.getLogger(__name__)


class ReceiveStatus(str, enum.Enum):
    DONE = "done"
    FAILED = "failed"
    """Prefill reported an abort, the peer was lost, or the notifications were inconsistent."""
    EXPIRED = "expired"
    """The deadline passed before every chunk arrived; prefill is told to stop."""
    CANCELLED = "cancelled"
    """This side gave up (client disconnect); prefill is told to stop."""


@dataclass(frozen=True)
class ReceiveResult:
    """Outcome of one expected request. ``pages``: the reserved decode pages.

    DONE: the pages are the caller's. Otherwise the receiver gives them back
    through ``release_pages``; never free them yourself. ``held``: they are
    out of the pool until every peer that may still write them has settled
    (False: already given back).
    """

    request_id: str
    status: ReceiveStatus
    pages: tuple[int, ...]
    chunks: int
    seconds: float
    reason: str = ""
    peer_agent: Optional[str] = None
    """The agent that pushed (None when an any-peer wait ended before anyone did)."""
    held: bool = False

    @property
    def ok(self) -> bool:
        return self.status is ReceiveStatus.DONE


@dataclass
class _Wait:
    request_id: str
    peer_agent: Optional[str]  # None: any handshaked peer, bound by its first notification
    pages: tuple[int, ...]
    started: float
    deadline: float
    got: set[int] = field(default_factory=set)
    count: Optional[int] = None


@dataclass
class _Held:
    """Pages of an ended request that ``writers`` (agent names) may still WRITE into."""

    request_id: str
    pages: tuple[int, ...]
    writers: set[str]
    reason: str
    since: float
    cancel_sent: float


class Receiver:
    """Tracks requests this decode worker expects from prefill peers. Drive from one thread.

    ``peers``: when given, `expect` requires a handshaked peer and a request
    fails as soon as its peer leaves the book (forgotten, or superseded by a
    restart: the old process will never complete it); any-peer waits need it.
    ``release_pages``: called with the page ids (a tuple of int) of a request
    that did not end DONE, once no peer can write them any more (e.g. the
    page pool's ``free``). ``resend_cancel_s``: how often a held request's
    cancel is sent again to the peers that have not settled.
    """

    def __init__(
        self,
        agent: TransferAgent,
        peers: Optional[PeerBook] = None,
        *,
        release_pages: Callable[[tuple[int, ...]], None],
        clock: Callable[[], float] = time.monotonic,
        remember_finished: int = 65536,
        resend_cancel_s: float = 1.0,
    ):
        self.agent = agent
        self.peers = peers
        self.release_pages = release_pages
        self.clock = clock
        self.resend_cancel_s = resend_cancel_s
        self._waits: dict[str, _Wait] = {}
        self._held: dict[str, _Held] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_finished
        self.ignored_notifs = 0
        self.settled = 0
        """Held requests whose pages were given back after their writers settled or left."""

    @property
    def active(self) -> list[str]:
        return list(self._waits)

    @property
    def held(self) -> dict[str, tuple[int, ...]]:
        """Ended requests whose pages are held (request id -> page ids) until their writers settle."""
        return {rid: h.pages for rid, h in self._held.items()}

    @property
    def held_pages(self) -> int:
        return sum(len(h.pages) for h in self._held.values())

    def writers_of(self, request_id: str) -> set[str]:
        """The agents a held request still waits on (empty if not held)."""
        h = self._held.get(request_id)
        return set() if h is None else set(h.writers)

    @property
    def has_work(self) -> bool:
        """Something to poll for: a wait, or held pages to give back."""
        return bool(self._waits or self._held)

    def expect(
        self, request_id: str, peer_agent: Optional[str], prompt_len: int, pages: Sequence[int], deadline_s: float
    ) -> None:
        """Wait for ``request_id`` from ``peer_agent`` into ``pages``; call before prefill can push.

        ``pages`` must hold ``pages_for_tokens(prompt_len)`` ids. ``peer_agent``
        None: from whichever handshaked peer notifies first (module doc).
        """
        if request_id in self._waits or request_id in self._finished:
            raise ValueError(f"request id {request_id!r} already used: use a fresh id per attempt")
        if peer_agent is None and self.peers is None:
            # Who may write an unbound wait's pages after it ended is "any
            # handshaked peer": without a book there is nobody to ask.
            raise ValueError("an any-peer wait (peer_agent None) needs a Receiver with a PeerBook")
        n = pages_for_tokens(prompt_len)
        if len(pages) != n:
            raise PlanError(f"request {request_id!r}: prompt of {prompt_len} tokens needs {n} pages, got {len(pages)}")
        if self.peers is not None and peer_agent is not None:
            self.peers.get(peer_agent)  # UnknownPeerError: handshake first
        now = self.clock()
        self._waits[request_id] = _Wait(request_id, peer_agent, tuple(int(p) for p in pages), now, now + deadline_s)

    def peer_of(self, request_id: str) -> Optional[str]:
        """The agent a waiting request expects (None: an any-peer wait not bound yet, or not waiting)."""
        w = self._waits.get(request_id)
        return None if w is None else w.peer_agent

    def poll(self) -> list[ReceiveResult]:
        """Read notifications and deadlines; returns the requests that ended since the last call."""
        out: list[ReceiveResult] = []
        for sender, msg in self.agent.take(ChunkDone, PushAborted, PushSettled):
            if not isinstance(msg, ChunkDone) and self._settle(sender, msg.request_id):
                continue  # the answer a held request waited for
            w = self._waits.get(msg.request_id)
            if isinstance(msg, PushSettled):
                w = None  # settles only a held request: a stale answer otherwise
            if w is not None and w.peer_agent is None and (self.peers is None or self.peers.knows(sender)):
                w.peer_agent = sender  # an any-peer wait binds to its first handshaked sender
            if w is None or sender != w.peer_agent:
                self.ignored_notifs += 1
                continue
            if isinstance(msg, PushAborted):
                # Prefill sends it after its WRITEs ended: nothing more can land.
                out.append(self._end(w, ReceiveStatus.FAILED, f"prefill aborted: {msg.reason}", writers=set()))
            elif (res := self._on_chunk(w, msg)) is not None:
                out.append(res)
        now = self.clock()
        for w in list(self._waits.values()):
            if self.peers is not None and w.peer_agent is not None and not self.peers.knows(w.peer_agent):
                # Dead or superseded: that process can no longer write here.
                reason = f"peer {w.peer_agent} forgotten or restarted"
                out.append(self._end(w, ReceiveStatus.FAILED, reason, writers=set()))
            elif now > w.deadline:
                reason = f"deadline of {w.deadline - w.started:.3f}s passed with {len(w.got)} chunk(s) received"
                out.append(self._end(w, ReceiveStatus.EXPIRED, reason))
        self._advance_held(now)
        return out

    def cancel(self, request_id: str, reason: str) -> Optional[ReceiveResult]:
        """Give up on a request now (client gone); its possible writers are told. None if not waiting."""
        w = self._waits.get(request_id)
        if w is None:
            return None
        return self._end(w, ReceiveStatus.CANCELLED, reason)

    def peer_lost(self, peer_agent: str, reason: str = "peer lost") -> list[ReceiveResult]:
        """Fail every request expected from ``peer_agent`` (it died); the peer is not contacted.

        Unbound any-peer waits are not affected: nothing says that peer would
        have pushed them. Held requests stop waiting for it (a dead process
        writes nothing).
        """
        lost = [w for w in self._waits.values() if w.peer_agent == peer_agent]
        out = [self._end(w, ReceiveStatus.FAILED, reason, writers=set()) for w in lost]
        for h in list(self._held.values()):
            if peer_agent in h.writers:
                h.writers.discard(peer_agent)
                if not h.writers:
                    self._release(h)
        return out

    # -- internals ----------------------------------------------------------

    def _on_chunk(self, w: _Wait, msg: ChunkDone) -> Optional[ReceiveResult]:
        if msg.count is not None:
            if msg.pages != len(w.pages):
                # Both sides must derive the count from the prompt length with
                # the same helper; a mismatch means one side's cache is wrong.
                return self._end(w, ReceiveStatus.FAILED, f"prefill pushed {msg.pages} pages, {len(w.pages)} reserved")
            w.count = msg.count
        w.got.add(msg.index)
        if w.count is not None:
            if max(w.got) >= w.count:
                return self._end(w, ReceiveStatus.FAILED, f"chunk index {max(w.got)} beyond count {w.count}")
            if len(w.got) == w.count:
                return self._end(w, ReceiveStatus.DONE, "")
        return None

    def _possible_writers(self, w: _Wait) -> set[str]:
        """Agents that may have posted a WRITE into ``w``'s pages that has not landed yet."""
        if w.peer_agent is not None:
            if self.peers is not None and not self.peers.knows(w.peer_agent):
                return set()  # dead or superseded
            return {w.peer_agent}
        # Unbound: whichever handshaked peer got the task may be pushing
        # without its first notification having arrived yet.
        return {p.agent_name for p in self.peers.peers()}

    def _end(self, w: _Wait, status: ReceiveStatus, reason: str, writers: Optional[set[str]] = None) -> ReceiveResult:
        """End ``w``. ``writers``: who may still write its pages (None: work it out; the end is this side's)."""
        del self._waits[w.request_id]
        self._finished[w.request_id] = None
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        held = False
        if status is not ReceiveStatus.DONE:
            log.warning("receive of %s from %s %s: %s", w.request_id, w.peer_agent, status.value, reason)
            if writers is None:
                writers = self._possible_writers(w)
            if writers:
                now = self.clock()
                h = _Held(w.request_id, w.pages, set(writers), reason, now, now)
                self._held[w.request_id] = h
                self._tell(h)
                held = True
            else:
                self.release_pages(w.pages)
        return ReceiveResult(w.request_id, status, w.pages, len(w.got), self.clock() - w.started, reason,
                             w.peer_agent, held)

    def _tell(self, h: _Held) -> None:
        for agent in sorted(h.writers):
            try:
                self.agent.notify(agent, PushCancelled(h.request_id, h.reason))
            except Exception as e:  # noqa: BLE001 - the peer may be dead: kept until it settles or leaves the book
                log.debug("cancel notification to %s: %s", agent, e)

    def _settle(self, sender: str, request_id: str) -> bool:
        """``sender`` has no WRITE of ``request_id`` in flight; True if a held request waited for that."""
        h = self._held.get(request_id)
        if h is None or sender not in h.writers:
            return False
        h.writers.discard(sender)
        if not h.writers:
            self._release(h)
        return True

    def _advance_held(self, now: float) -> None:
        for h in list(self._held.values()):
            if self.peers is not None:
                h.writers = {a for a in h.writers if self.peers.knows(a)}
            if not h.writers:
                self._release(h)
            elif now - h.cancel_sent >= self.resend_cancel_s:
                h.cancel_sent = now
                self._tell(h)

    def _release(self, h: _Held) -> None:
        del self._held[h.request_id]
        self.settled += 1
        self.release_pages(h.pages)
