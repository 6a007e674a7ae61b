"""The prefill → decode KV link of a tensor-parallel replica: one NIXL agent
per rank, pages pushed rank i → rank i.

Every rank caches the whole MLA latent and indexer keys (they are shared by
all heads), so each rank pair is a complete, independent copy of the
single-rank link: prefill rank i's `Pusher` writes into decode rank i's pages,
decode rank i's `Receiver` counts rank i's notifications. This module gives
the driver of a replica (`PrefillWorker` / `DecodeWorker`, the Serve engine
threads) the same surface as `KVLink`, `Pusher`, `Receiver` and `PeerBook`,
over the ranks:

- names: the replica's agent is ``worker_id@epoch``; rank i's NIXL agent is
  ``worker_id.r<i>@epoch`` (one epoch for the whole replica), so peers map
  one to the other without a lookup (`rank_agent_name`, `group_agent_name`);
- handshake: a `GroupOffer` carries every rank's `HandshakeOffer`; accepting
  it has rank i accept the peer's rank i (both replicas need the same
  tensor-parallel size);
- a request ends when every rank's transfer ended: DONE only if every rank's
  is; the first rank that fails has the others aborted (prefill) or
  cancelled (decode), and the failure is the request's;
- decode pages of a request that did not end DONE go back to the driver's
  pool only once *every* rank's receiver gave them back (each holds them
  until its prefill rank settled, see ``transfer.receiver``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from transfer import (
    PushResult,
    PushStatus,
    ReceiveResult,
    ReceiveStatus,
    StaleEpochError,
    TransferError,
)
from transfer.handshake import EpochBook


def rank_agent_name(group_agent: str, rank: int) -> str:
    """``worker@epoch`` -> rank ``rank``'s NIXL agent ``worker.r<rank>@epoch``."""
    worker, sep, epoch = group_agent.rpartition("@")
    if not sep:
        raise ValueError(f"agent name {group_agent!r} has no '@epoch'")
    return f"{worker}.r{rank}@{epoch}"


def group_agent_name(rank_agent: str) -> str:
    """Inverse of `rank_agent_name`."""
    worker, _, epoch = rank_agent.rpartition("@")
    base, sep, rank = worker.rpartition(".r")
    if not sep or not rank.isdigit():
        raise ValueError(f"{rank_agent!r} is not a rank agent name")
    return f"{base}@{epoch}"


@dataclass(frozen=True)
class GroupAgent:
    """The replica's agent identity (what `TransferAgent` exposes and the deployments read)."""

    worker_id: str
    epoch: int

    @property
    def name(self) -> str:
        return f"{self.worker_id}@{self.epoch}"


@dataclass(frozen=True)
class GroupOffer:
    """Every rank's handshake offer (``ranks[i]``: rank i's `HandshakeOffer` bytes)."""

    worker_id: str
    epoch: int
    ranks: tuple[bytes, ...]

    @property
    def agent_name(self) -> str:
        return GroupAgent(self.worker_id, self.epoch).name

    def to_bytes(self) -> bytes:
        return json.dumps({"group": {"worker_id": self.worker_id, "epoch": self.epoch,
                                     "ranks": [base64.b64encode(r).decode() for r in self.ranks]}},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "GroupOffer":
        try:
            g = json.loads(raw)["group"]
            return cls(str(g["worker_id"]), int(g["epoch"]), tuple(base64.b64decode(r) for r in g["ranks"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"not a tensor-parallel handshake offer ({e}): a single-rank replica's "
                                "offer? prefill and decode need the same tensor_parallel_size") from e


@dataclass(frozen=True)
class GroupPeer:
    worker_id: str
    epoch: int
    agent_name: str


class GroupPeerBook(EpochBook):
    """Peer replicas of one rank group (at most the newest epoch per worker), each rank handshaked with its twin."""

    def __init__(self, group, own: GroupOffer):
        super().__init__()
        self.group, self.own = group, own

    def offer(self) -> GroupOffer:
        return self.own

    def accept(self, offer: Union[GroupOffer, bytes]) -> GroupPeer:
        if isinstance(offer, (bytes, bytearray)):
            offer = GroupOffer.from_bytes(bytes(offer))
        if len(offer.ranks) != self.group.size:
            raise TransferError(f"{offer.agent_name} has {len(offer.ranks)} ranks, this replica {self.group.size}: "
                                "pages go rank i -> rank i, so tensor_parallel_size must agree")
        known = self._by_worker.get(offer.worker_id)
        if known is not None:
            if offer.epoch < known.epoch:
                raise StaleEpochError(f"offer from {offer.agent_name} is older than known epoch {known.agent_name}")
            if offer.epoch == known.epoch:
                return known
            self.forget(known.agent_name)
        try:
            self.group.call_each("accept", [(r,) for r in offer.ranks])
        except Exception:
            # Some ranks may have accepted: undo, so no rank knows a peer the replica does not.
            self.group.call_each("forget", [(rank_agent_name(offer.agent_name, r),) for r in range(self.group.size)])
            raise
        peer = GroupPeer(offer.worker_id, offer.epoch, offer.agent_name)
        self._by_worker[offer.worker_id] = peer
        return peer

    def respond(self, offer: Union[GroupOffer, bytes]) -> bytes:
        self.accept(offer)
        return self.own.to_bytes()

    def _dropped(self, agent_name: str) -> None:
        self.group.call_each("forget", [(rank_agent_name(agent_name, r),) for r in range(self.group.size)])


@dataclass
class _Ending:
    """One request across the ranks: each rank's result once its transfer ended."""

    pages: tuple[int, ...]
    results: dict[int, object] = field(default_factory=dict)
    failure: object | None = None  # the first non-DONE rank result


def _first_failure(ending: _Ending, results: dict[int, object], ok) -> None:
    for r in sorted(results):
        if ending.failure is None and not ok(results[r]):
            ending.failure = results[r]


class GroupPusher:
    """`Pusher` over the ranks of a prefill replica (see the module doc)."""

    def __init__(self, group):
        self.group = group
        self._jobs: dict[str, _Ending] = {}

    @property
    def active(self) -> list[str]:
        return list(self._jobs)

    def has_work(self) -> bool:
        # A rank may owe decode an answer to a cancel of a request this driver
        # never began: only the ranks know.
        return bool(self._jobs) or any(self.group.call("push_has_work"))

    def begin(self, request_id: str, peer_agent: str, prompt_len: int, local_pages: Sequence[int],
              remote_pages: Sequence[int], deadline_s: float, prepare: bool = True) -> None:
        args = [(request_id, rank_agent_name(peer_agent, r), prompt_len, list(local_pages), list(remote_pages),
                 deadline_s, prepare) for r in range(self.group.size)]
        outcomes = self.group.call_each("push_begin", args, return_exceptions=True)
        errors = [e for e in outcomes if isinstance(e, BaseException)]
        if errors:
            for r, e in enumerate(outcomes):
                if not isinstance(e, BaseException):
                    self.group.call_rank(r, "push_abort", request_id, f"rank begin failed: {errors[0]}")
            raise errors[0]
        self._jobs[request_id] = _Ending(tuple(local_pages))

    def push(self, request_id: str, tokens_done: int, written: bool = False) -> bool:
        """``written`` is not passed on: the driver's read-back waited for rank 0's stream only (the
        other ranks return nothing), so each rank fences its own pages."""
        if request_id not in self._jobs:
            return False
        return all(self.group.call("push", request_id, tokens_done))

    def poll(self, spin_s: float = 0.0) -> list[PushResult]:
        # Each rank spins on its own WRITEs (`Pusher.poll`), all at once.
        for r, results in enumerate(self.group.call("push_poll", spin_s)):
            for res in results:
                if res.request_id in self._jobs:
                    self._jobs[res.request_id].results[r] = res
        return self._settle()

    def abort(self, request_id: str, reason: str) -> Optional[PushResult]:
        ending = self._jobs.get(request_id)
        if ending is None:
            return None
        self._end_rest(request_id, ending, reason)
        out = self._settle(only=request_id)
        return out[0] if out else None

    def warm_up(self, peer_agent: str, local_page: int = 0, remote_page: int = 0) -> float:
        """Every rank pair's first WRITE; returns the slowest pair's seconds."""
        args = [(rank_agent_name(peer_agent, r), local_page, remote_page) for r in range(self.group.size)]
        return max(self.group.call_each("warm_up", args))

    def _end_rest(self, request_id: str, ending: _Ending, reason: str) -> None:
        for r in range(self.group.size):
            if r not in ending.results:
                res = self.group.call_rank(r, "push_abort", request_id, reason)
                if res is not None:
                    ending.results[r] = res

    def _settle(self, only: str | None = None) -> list[PushResult]:
        out = []
        for rid, ending in list(self._jobs.items()):
            if only is not None and rid != only:
                continue
            _first_failure(ending, ending.results, lambda res: res.status is PushStatus.DONE)
            if ending.failure is not None and len(ending.results) < self.group.size:
                self._end_rest(rid, ending, f"another rank's push {ending.failure.status.value}: {ending.failure.reason}")
            if len(ending.results) < self.group.size:
                continue
            del self._jobs[rid]
            rs = list(ending.results.values())
            f = ending.failure
            out.append(PushResult(rid, PushStatus.DONE if f is None else f.status, ending.pages,
                                  min(x.chunks for x in rs), sum(x.nbytes for x in rs), max(x.seconds for x in rs),
                                  "" if f is None else f.reason, max(x.tail_seconds for x in rs)))
        return out


class GroupReceiver:
    """`Receiver` over the ranks of a decode replica (see the module doc).

    ``release_pages``: the driver's pool ``free``, called once per request that
    did not end DONE, when every rank has given its pages back.
    """

    def __init__(self, group, release_pages: Callable[[tuple[int, ...]], None]):
        self.group, self.release_pages = group, release_pages
        self._waits: dict[str, _Ending] = {}
        # Pages of ended requests (not DONE) -> ranks that gave them back; at
        # all ranks they go to ``release_pages``. ``_early``: given back by a
        # rank before the request ended on every rank.
        self._held: dict[tuple[int, ...], set[int]] = {}
        self._early: dict[tuple[int, ...], set[int]] = {}

    @property
    def active(self) -> list[str]:
        return list(self._waits)

    @property
    def has_work(self) -> bool:
        return bool(self._waits or self._held)

    @property
    def held_pages(self) -> int:
        return sum(len(p) for p in self._held)

    def expect(self, request_id: str, peer_agent: Optional[str], prompt_len: int, pages: Sequence[int],
               deadline_s: float) -> None:
        args = [(request_id, None if peer_agent is None else rank_agent_name(peer_agent, r), prompt_len,
                 list(pages), deadline_s) for r in range(self.group.size)]
        outcomes = self.group.call_each("recv_expect", args, return_exceptions=True)
        errors = [e for e in outcomes if isinstance(e, BaseException)]
        if errors:
            # Nobody was asked to push yet: the ranks that began waiting drop
            # it, and the caller frees the pages (as after a single receiver's raise).
            for r, e in enumerate(outcomes):
                if not isinstance(e, BaseException):
                    self.group.call_rank(r, "recv_cancel", request_id, f"rank expect failed: {errors[0]}")
            raise errors[0]
        self._waits[request_id] = _Ending(tuple(int(p) for p in pages))

    def peer_of(self, request_id: str) -> Optional[str]:
        if request_id not in self._waits:
            return None
        bound = self.group.call_rank(0, "recv_peer_of", request_id)
        return None if bound is None else group_agent_name(bound)

    def poll(self) -> list[ReceiveResult]:
        for r, (results, released) in enumerate(self.group.call("recv_poll")):
            for res in results:
                if res.request_id in self._waits:
                    self._waits[res.request_id].results[r] = res
            self._release(r, released)
        return self._settle()

    def cancel(self, request_id: str, reason: str) -> Optional[ReceiveResult]:
        ending = self._waits.get(request_id)
        if ending is None:
            return None
        self._end_rest(request_id, ending, reason)
        out = self._settle(only=request_id)
        return out[0] if out else None

    def _release(self, rank: int, released: list[tuple[int, ...]]) -> None:
        for pages in map(tuple, released):
            if pages in self._held:
                self._held[pages].add(rank)
                self._maybe_release(pages)
            elif any(e.pages == pages for e in self._waits.values()):
                self._early.setdefault(pages, set()).add(rank)
            # else: pages of a wait dropped before it began (the caller freed them)

    def _maybe_release(self, pages: tuple[int, ...]) -> None:
        if len(self._held[pages]) == self.group.size:
            del self._held[pages]
            self.release_pages(pages)

    def _end_rest(self, request_id: str, ending: _Ending, reason: str) -> None:
        for r in range(self.group.size):
            if r not in ending.results:
                res, released = self.group.call_rank(r, "recv_cancel", request_id, reason)
                if res is not None:
                    ending.results[r] = res
                self._release(r, released)

    def _settle(self, only: str | None = None) -> list[ReceiveResult]:
        out = []
        for rid, ending in list(self._waits.items()):
            if only is not None and rid != only:
                continue
            _first_failure(ending, ending.results, lambda res: res.status is ReceiveStatus.DONE)
            if ending.failure is None:
                bound = {res.peer_agent and group_agent_name(res.peer_agent) for res in ending.results.values()}
                if len(bound) > 1:  # any-peer waits of two ranks bound to different replicas: never trust it
                    ending.failure = ReceiveResult(rid, ReceiveStatus.FAILED, ending.pages, 0, 0.0,
                                                   f"ranks received from different replicas: {sorted(bound)}")
            if ending.failure is not None and len(ending.results) < self.group.size:
                self._end_rest(rid, ending, f"another rank's receive {ending.failure.status.value}: "
                                            f"{ending.failure.reason}")
            if len(ending.results) < self.group.size:
                continue
            del self._waits[rid]
            rs = list(ending.results.values())
            f = ending.failure
            peer = next((group_agent_name(x.peer_agent) for x in rs if x.peer_agent), None)
            early = self._early.pop(ending.pages, set())
            held = False
            if f is not None:
                # A rank whose transfer completed gives nothing back: no WRITE can land there any more.
                done = {r for r, x in ending.results.items() if x.status is ReceiveStatus.DONE}
                self._held[ending.pages] = early | done
                self._maybe_release(ending.pages)
                held = ending.pages in self._held
            out.append(ReceiveResult(rid, ReceiveStatus.DONE if f is None else f.status, ending.pages,
                                     min(x.chunks for x in rs), max(x.seconds for x in rs),
                                     "" if f is None else f.reason, peer, held))
        return out


class GroupLink:
    """A rank group's end of the KV link: the `KVLink` surface (``agent``, ``peers``, ``pusher()``, ``receiver()``)."""

    def __init__(self, group, worker_id: str, epoch: int):
        if "@" in worker_id:
            raise ValueError(f"worker_id must not contain '@': {worker_id!r}")
        self.group = group
        self.agent = GroupAgent(worker_id, epoch)
        offers = group.call_each("open_link", [(f"{worker_id}.r{r}", epoch) for r in range(group.size)])
        self.peers = GroupPeerBook(group, GroupOffer(worker_id, epoch, tuple(offers)))

    def pusher(self) -> GroupPusher:
        return GroupPusher(self.group)

    def receiver(self, release_pages: Callable[[tuple[int, ...]], None]) -> GroupReceiver:
        return GroupReceiver(self.group, release_pages)

    def handshake(self, other: "GroupLink") -> None:
        """Both directions (in-process pair), as `KVLink.handshake`."""
        self.peers.accept(other.peers.respond(self.peers.offer()))

    def close(self) -> None:
        self.group.call("close_link")
