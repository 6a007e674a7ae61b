"""One replica's side of the peer directory: heartbeat out, peers in.

Every ``period_s`` a replica publishes its load snapshot (and, the first
time, its handshake offer) and reads the other pool's live entries: an agent
it has not handshaked with (a new replica, or a new epoch of a restarted
one) is handed to ``learn``; an agent that left the directory is handed to
``forget``. ``learn`` / ``forget`` run the handshake on the replica's engine
thread, which owns the NIXL agent. A replica without an offer (a
monolithic decode replica has no NIXL agent) only heartbeats its load.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console


class PeerSync:
    def __init__(self, directory, role: str, worker_id: str, agent: str, offer: bytes | None,
                 stats: Callable[[], dict[str, Any]], learn: Callable[[dict[str, Any]], Awaitable[None]],
                 forget: Callable[[str], Awaitable[None]], extra: dict[str, Any] | None = None,
                 period_s: float = 0.5):
        self.directory = directory
        self.role, self.other = role, "decode" if role == "prefill" else "prefill"
        self.worker_id, self.agent, self.offer = worker_id, agent, offer
        self.stats, self.learn, self.forget = stats, learn, forget
        self.extra = extra or {}
        self.period_s = period_s
        self.known: set[str] = set()
        """Peer agents handshaked with (the decode replica passes these to its prefill router)."""
        self.changed = asyncio.Event()
        """Set whenever ``known`` changes."""
        self._offer_held = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Publish and learn once (so a replica is ready only after its first round), then keep going."""
        await self.round()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.directory.remove.remote(self.role, self.worker_id)
        except Exception as e:  # noqa: BLE001 - the directory may already be gone at shutdown
            log.debug("leaving the directory: %s", e)

    async def round(self) -> None:
        offer = None if self._offer_held else self.offer
        self._offer_held = await self.directory.publish.remote(
            self.role, self.worker_id, self.agent, offer, self.stats(), self.extra)
        if self.offer is None:
            return  # no link: no peers to learn
        entries = await self.directory.entries.remote(self.other)
        live = {e["agent"] for e in entries}
        for e in entries:
            if e["agent"] in self.known:
                continue
            try:
                await self.learn(e)
            except Exception as exc:  # noqa: BLE001 - an incompatible peer must not stop the others
                log.warning("%s %s: handshake with %s failed: %s", self.role, self.agent, e["agent"], exc)
                continue
            self.known.add(e["agent"])
            self.changed.set()
        for agent in sorted(self.known - live):
            await self.forget(agent)
            self.known.discard(agent)
            self.changed.set()

    async def wait_for_peer(self, timeout_s: float) -> bool:
        """Wait until at least one peer is known; False on timeout."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not self.known:
            self.changed.clear()
            left = end - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return bool(self.known)
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a missed heartbeat is retried next period
                log.warning("%s %s: directory round failed: %s", self.role, self.agent, e)
