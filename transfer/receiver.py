"""Decode side: wait for the pages a prefill peer pushes into this worker's reserved pages.

Life of a request (every `expect` yields exactly one `ReceiveResult`, from
`poll`, `cancel` or `peer_lost`; on DONE the pages hold the prompt's caches,
otherwise the caller frees ``result.pages``):

    pages = pool.allocate(pages_for_tokens(prompt_len))
    receiver.expect(rid, prefill_agent, prompt_len, pages, deadline_s)   # before asking prefill
    ... receiver.poll() -> [ReceiveResult(rid, DONE | FAILED | EXPIRED | CANCELLED, pages, ...)]

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
it does. Until bound, nobody can be told of a cancel or an expiry: the caller
stops the prefill call itself (the Serve deployments cancel it).
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
from transfer.messages import ChunkDone, PushAborted, PushCancelled

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
    """Outcome of one expected request. ``pages``: the reserved decode pages (free them unless DONE)."""

    request_id: str
    status: ReceiveStatus
    pages: tuple[int, ...]
    chunks: int
    seconds: float
    reason: str = ""
    peer_agent: Optional[str] = None
    """The agent that pushed (None when an any-peer wait ended before anyone did)."""

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


class Receiver:
    """Tracks requests this decode worker expects from prefill peers. Drive from one thread.

    ``peers``: when given, `expect` requires a handshaked peer and a request
    fails as soon as its peer leaves the book (forgotten, or superseded by a
    restart: the old process will never complete it).
    """

    def __init__(
        self,
        agent: TransferAgent,
        peers: Optional[PeerBook] = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        remember_finished: int = 65536,
    ):
        self.agent = agent
        self.peers = peers
        self.clock = clock
        self._waits: dict[str, _Wait] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_finished
        self.ignored_notifs = 0

    @property
    def active(self) -> list[str]:
        return list(self._waits)

    def expect(
        self, request_id: str, peer_agent: Optional[str], prompt_len: int, pages: Sequence[int], deadline_s: float
    ) -> None:
        """Wait for ``request_id`` from ``peer_agent`` into ``pages``; call before prefill can push.

        ``pages`` must hold ``pages_for_tokens(prompt_len)`` ids. ``peer_agent``
        None: from whichever handshaked peer notifies first (module doc).
        """
        if request_id in self._waits or request_id in self._finished:
            raise ValueError(f"request id {request_id!r} already used: use a fresh id per attempt")
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
        for sender, msg in self.agent.take(ChunkDone, PushAborted):
            w = self._waits.get(msg.request_id)
            if w is not None and w.peer_agent is None and (self.peers is None or self.peers.knows(sender)):
                w.peer_agent = sender  # an any-peer wait binds to its first handshaked sender
            if w is None or sender != w.peer_agent:
                self.ignored_notifs += 1
                continue
            if isinstance(msg, PushAborted):
                out.append(self._end(w, ReceiveStatus.FAILED, f"prefill aborted: {msg.reason}", False))
            elif (res := self._on_chunk(w, msg)) is not None:
                out.append(res)
        now = self.clock()
        for w in list(self._waits.values()):
            if self.peers is not None and w.peer_agent is not None and not self.peers.knows(w.peer_agent):
                out.append(self._end(w, ReceiveStatus.FAILED, f"peer {w.peer_agent} forgotten or restarted", False))
            elif now > w.deadline:
                reason = f"deadline of {w.deadline - w.started:.3f}s passed with {len(w.got)} chunk(s) received"
                out.append(self._end(w, ReceiveStatus.EXPIRED, reason, tell_peer=True))
        return out

    def cancel(self, request_id: str, reason: str) -> Optional[ReceiveResult]:
        """Give up on a request now (client gone); prefill is told. None if not waiting."""
        w = self._waits.get(request_id)
        if w is None:
            return None
        return self._end(w, ReceiveStatus.CANCELLED, reason, tell_peer=True)

    def peer_lost(self, peer_agent: str, reason: str = "peer lost") -> list[ReceiveResult]:
        """Fail every request expected from ``peer_agent`` (it died); the peer is not contacted.

        Unbound any-peer waits are not affected: nothing says that peer would have pushed them.
        """
        lost = [w for w in self._waits.values() if w.peer_agent == peer_agent]
        return [self._end(w, ReceiveStatus.FAILED, reason, tell_peer=False) for w in lost]

    # -- internals ----------------------------------------------------------

    def _on_chunk(self, w: _Wait, msg: ChunkDone) -> Optional[ReceiveResult]:
        if msg.count is not None:
            if msg.pages != len(w.pages):
                # Both sides must derive the count from the prompt length with
                # the same helper; a mismatch means one side's cache is wrong.
                return self._end(w, ReceiveStatus.FAILED, f"prefill pushed {msg.pages} pages, {len(w.pages)} reserved", True)
            w.count = msg.count
        w.got.add(msg.index)
        if w.count is not None:
            if max(w.got) >= w.count:
                return self._end(w, ReceiveStatus.FAILED, f"chunk index {max(w.got)} beyond count {w.count}", True)
            if len(w.got) == w.count:
                return self._end(w, ReceiveStatus.DONE, "", tell_peer=False)
        return None

    def _end(self, w: _Wait, status: ReceiveStatus, reason: str, tell_peer: bool) -> ReceiveResult:
        del self._waits[w.request_id]
        self._finished[w.request_id] = None
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        if tell_peer and w.peer_agent is not None:
            try:
                self.agent.notify(w.peer_agent, PushCancelled(w.request_id, reason))
            except Exception as e:  # noqa: BLE001 - the peer may be dead or never handshaked
                log.debug("cancel notification to %s: %s", w.peer_agent, e)
        if status is not ReceiveStatus.DONE:
            log.warning("receive of %s from %s %s: %s", w.request_id, w.peer_agent, status.value, reason)
        return ReceiveResult(w.request_id, status, w.pages, len(w.got), self.clock() - w.started, reason, w.peer_agent)
