"""The handshake between a decode and a prefill agent, and the book of known peers.

Protocol (transport-agnostic: a Ray call in serving, a pipe in tests):

1. The initiator (decode, before it first sends a request to a prefill
   replica) sends ``book.offer().to_bytes()``.
2. The responder calls ``book.respond(offer_bytes)``: it checks
   compatibility (raising `CompatibilityError` naming each differing field),
   loads the initiator's NIXL metadata and returns its own offer.
3. The initiator calls ``book.accept(reply_bytes)`` with the same checks.

Accepting a peer also prepares its NIXL descriptor list over every page
of its regions (`TransferAgent.prepare_peer`); forgetting it releases the
list with the metadata.

An agent's name is ``worker_id@epoch``. A restarted worker has a new epoch,
hence a new name: requests naming it miss the book (`UnknownPeerError`) and
the caller handshakes again, and accepting the new epoch drops the old
epoch's metadata. Offers from an epoch older than the known one are refused
(`StaleEpochError`), so a delayed offer of a dead incarnation cannot replace
the live one.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Union

from transfer.agent import TransferAgent
from transfer.compat import CompatInfo, check_compatible
from transfer.errors import StaleEpochError, TransferError, UnknownPeerError
from transfer.regions import RegionTable


@dataclass(frozen=True)
class HandshakeOffer:
    """Everything a peer needs to push to (or notify) this agent.

    ``nixl_metadata``: opaque NIXL agent metadata; ``regions``: where each
    cache lives; ``compat_hash``: ``compat.digest()`` as computed by the sender.
    """

    worker_id: str
    epoch: int
    agent_name: str
    nixl_metadata: bytes
    regions: RegionTable
    compat: CompatInfo
    compat_hash: str

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "worker_id": self.worker_id,
                "epoch": self.epoch,
                "agent_name": self.agent_name,
                "nixl_metadata": base64.b64encode(self.nixl_metadata).decode(),
                "regions": self.regions.to_wire(),
                "compat": self.compat.to_wire(),
                "compat_hash": self.compat_hash,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "HandshakeOffer":
        try:
            d = json.loads(raw)
            return cls(
                worker_id=str(d["worker_id"]),
                epoch=int(d["epoch"]),
                agent_name=str(d["agent_name"]),
                nixl_metadata=base64.b64decode(d["nixl_metadata"]),
                regions=RegionTable.from_wire(d["regions"]),
                compat=CompatInfo.from_wire(d["compat"]),
                compat_hash=str(d["compat_hash"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"malformed handshake offer: {e}") from e


@dataclass(frozen=True)
class Peer:
    """A peer agent this worker has handshaked with."""

    worker_id: str
    epoch: int
    agent_name: str
    regions: RegionTable
    compat: CompatInfo


class EpochBook:
    """Peers by worker id, at most one (the newest) epoch each; a peer is named
    ``worker_id@epoch`` (its ``agent_name``). Subclasses add the handshake and
    say in `_dropped` what forgetting a peer releases."""

    def __init__(self) -> None:
        self._by_worker: dict[str, Any] = {}

    def get(self, agent_name: str):
        """The peer named ``agent_name``; `UnknownPeerError` if never handshaked or superseded."""
        worker_id = agent_name.rpartition("@")[0]
        peer = self._by_worker.get(worker_id)
        if peer is None or peer.agent_name != agent_name:
            current = f" (known epoch: {peer.agent_name})" if peer else ""
            raise UnknownPeerError(f"no handshake with agent {agent_name!r}{current}: handshake again")
        return peer

    def knows(self, agent_name: str) -> bool:
        try:
            self.get(agent_name)
            return True
        except UnknownPeerError:
            return False

    def forget(self, agent_name: str) -> None:
        """Drop a peer (it died or restarted); unknown names are ignored."""
        if not self.knows(agent_name):
            return
        del self._by_worker[agent_name.rpartition("@")[0]]
        self._dropped(agent_name)

    def _dropped(self, agent_name: str) -> None:
        raise NotImplementedError

    def peers(self) -> list:
        return list(self._by_worker.values())


class PeerBook(EpochBook):
    """Peers of one `TransferAgent`, at most one (the newest) epoch per worker."""

    def __init__(self, agent: TransferAgent):
        super().__init__()
        self.agent = agent

    def offer(self) -> HandshakeOffer:
        a = self.agent
        return HandshakeOffer(
            worker_id=a.worker_id,
            epoch=a.epoch,
            agent_name=a.name,
            nixl_metadata=a.metadata(),
            regions=a.table,
            compat=a.compat,
            compat_hash=a.compat.digest(),
        )

    def accept(self, offer: Union[HandshakeOffer, bytes]) -> Peer:
        """Check and load a peer's offer; returns the peer. Idempotent for a known epoch."""
        if isinstance(offer, (bytes, bytearray)):
            offer = HandshakeOffer.from_bytes(bytes(offer))
        if offer.worker_id == self.agent.worker_id:
            raise TransferError(f"handshake with own worker id {offer.worker_id!r}")
        check_compatible(
            offer.agent_name, self.agent.compat, offer.compat, offer.compat_hash, self.agent.table, offer.regions
        )
        known = self._by_worker.get(offer.worker_id)
        if known is not None:
            if offer.epoch < known.epoch:
                raise StaleEpochError(
                    f"offer from {offer.agent_name} is older than known epoch {known.agent_name}"
                )
            if offer.epoch == known.epoch:
                return known
            # The worker restarted: its old agent's metadata must never be used again.
            self.forget(known.agent_name)
        name = self.agent.load_peer(offer.nixl_metadata)
        if name != offer.agent_name:
            self.agent.drop_peer(name)
            raise TransferError(f"offer names agent {offer.agent_name!r} but its metadata is {name!r}")
        try:
            # Once per peer: its descriptor list over every page of every region.
            self.agent.prepare_peer(name, offer.regions)
        except Exception as e:
            self.agent.drop_peer(name)
            raise TransferError(f"preparing the descriptor list of {name!r} failed: {e}") from e
        peer = Peer(offer.worker_id, offer.epoch, offer.agent_name, offer.regions, offer.compat)
        self._by_worker[offer.worker_id] = peer
        return peer

    def respond(self, offer: Union[HandshakeOffer, bytes]) -> bytes:
        """Responder side: accept the initiator's offer, reply with ours (bytes)."""
        self.accept(offer)
        return self.offer().to_bytes()

    def _dropped(self, agent_name: str) -> None:
        self.agent.drop_peer(agent_name)
