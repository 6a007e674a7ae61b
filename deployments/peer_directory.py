"""The peer directory: where prefill and decode replicas find each other.

A one-replica Serve deployment of the application (so it lives and dies with
it). Every prefill and decode replica publishes its NIXL handshake offer once
and then a heartbeat with its load figures; each replica reads the other
pool's entries to handshake with every peer before it serves (a new pair is
slow on its first transfer: DESIGN.md) and to notice new epochs and departed
peers. An entry whose heartbeat stopped for ``ttl_s`` is gone: its replica
died or was replaced, and peers forget its agent (failing its transfers at
once instead of at their deadline). The ingress reads the entries (without
offers) for ``/health`` and ``/stats``. A monolithic decode replica has no
NIXL agent and publishes no offer: it is listed there, but never handed to
a peer.
"""

from __future__ import annotations

import time
from typing import Any

from deployments.replica_stats import stats_class

ROLES = ("prefill", "decode")


class PeerDirectory:
    def __init__(self, ttl_s: float = 10.0):
        self.ttl_s = ttl_s
        self._entries: dict[str, dict[str, dict[str, Any]]] = {role: {} for role in ROLES}

    def publish(self, role: str, worker_id: str, agent: str, offer: bytes | None, stats: dict[str, Any],
                extra: dict[str, Any] | None = None) -> bool:
        """Record a heartbeat; returns whether the directory holds this agent's offer (False: send it).

        ``offer`` is sent with the first heartbeat only; a directory that
        restarted (and lost it) asks for it again through the return value.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        entry = self._entries[role].get(worker_id)
        if entry is None or entry["agent"] != agent:
            entry = {"worker_id": worker_id, "agent": agent, "offer": None, "since": time.time()}
            self._entries[role][worker_id] = entry
        if offer is not None:
            entry["offer"] = offer
        stats_class(role).from_dict(stats)  # a malformed report fails its sender's heartbeat, not a reader
        entry["stats"] = dict(stats)
        entry["extra"] = dict(extra or {})
        entry["seen"] = time.monotonic()
        return entry["offer"] is not None

    def remove(self, role: str, worker_id: str) -> None:
        """A replica shutting down leaves at once rather than after the TTL."""
        self._entries.get(role, {}).pop(worker_id, None)

    def _live(self, role: str) -> list[dict[str, Any]]:
        now = time.monotonic()
        table = self._entries[role]
        for wid in [w for w, e in table.items() if now - e["seen"] > self.ttl_s]:
            del table[wid]
        return list(table.values())

    def entries(self, role: str) -> list[dict[str, Any]]:
        """Live entries of ``role`` with their offers (what a peer handshakes from); an entry
        without one (no link, or an offer a restarted directory has yet to get back) is left out."""
        return [dict(e) for e in self._live(role) if e["offer"] is not None]

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Live entries of both roles without offers (with or without a link), with the age of
        their last heartbeat."""
        now = time.monotonic()
        return {
            role: [{"worker_id": e["worker_id"], "agent": e["agent"], "age_s": round(now - e["seen"], 3),
                    "stats": e["stats"], **e["extra"]} for e in self._live(role)]
            for role in ROLES
        }
