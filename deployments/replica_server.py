"""What a prefill and a decode replica share: starting the worker thread and
the peer directory entry, the stats behind `/stats` and Prometheus, and the
Serve hooks (routing stats, health, shutdown)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any, Callable

from deployments.app_config import AppConfig
from deployments.engine_process import EngineProcess
from deployments.peer_sync import PeerSync
from deployments.replica_build import build_worker_thread


class ReplicaServer:
    """Base of `PrefillServer` and `DecodeServer`; subclasses define ``_learn(entry)``."""

    worker_id: str

    async def _open_engine(self, role: str, cfg: AppConfig, app_args: dict[str, Any], model_dir: str,
                           fail_item: Callable[[str, str], Any]):
        """The role's engine: its worker thread in this process, or with ``engine_process`` the
        `EngineProcess` standing in for it (launched: the child has built the worker). ``cfg``: ``app_args``
        validated (the child validates the raw args itself). ``fail_item``: what an open stream receives if
        the engine process dies (the role's error output)."""
        if cfg.for_role(role).runs_engine_process:
            proc = EngineProcess(role, app_args, model_dir, self.worker_id, cfg.for_role(role).gil_switch_interval_ms,
                                 fail_item=fail_item, exit_with_engine=True)
            await asyncio.to_thread(proc.launch)
            return proc
        return await asyncio.to_thread(build_worker_thread, cfg, role, model_dir, self.worker_id)

    async def _start(self, thread, role: str, metrics, directory, extra: dict[str, Any],
                     gil_switch_interval_ms: float) -> bytes | None:
        """Start ``thread`` (a `WorkerThread`, or the `deployments.engine_process.EngineProcess` standing in
        for one) and publish this replica in ``directory``; returns the handshake offer (None for a worker
        without a KV link: a monolithic decode replica, which learns no peers).
        ``gil_switch_interval_ms``: the role's ``gil_switch_interval_ms`` (the whole process's)."""
        if thread.engine_pid is None:  # an engine process sets its own: nothing of the engine runs here
            sys.setswitchinterval(gil_switch_interval_ms / 1e3)
        self.thread = thread
        self.agent = thread.agent_name
        offer = thread.handshake_offer()
        thread.start()
        self.metrics = metrics
        self.sync = PeerSync(directory, role, self.worker_id, self.agent, offer, self._stats,
                             learn=self._learn, forget=self._forget,
                             extra={**extra, "pid": os.getpid(), "engine_pid": thread.engine_pid,
                                    # the engine loop's (this process's, or its engine process's own)
                                    "gil_switch_interval_ms": gil_switch_interval_ms})
        await self.sync.start()
        return offer

    def _stats(self) -> dict[str, Any]:
        """The latest snapshot for the directory (its wire form), updating this replica's metrics
        (gauges, and the engine steps since the last heartbeat; recording never raises)."""
        stats = self.thread.stats
        self.metrics.update(stats, self.thread.take_steps())
        return stats.to_dict()

    async def _learn(self, entry: dict[str, Any]) -> None:
        raise NotImplementedError

    async def _forget(self, agent: str) -> None:
        await self.thread.call(self.thread.forget_peer, agent)

    # ----------------------------------------------------------- Serve hooks
    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats: the latest snapshot as a plain dict (the routers read it back with `from_routing`)."""
        return self.thread.stats.to_dict()

    def check_health(self) -> None:
        self.thread.check()

    async def __del__(self):
        await self.sync.stop()
        await asyncio.to_thread(self.thread.stop)  # joins a thread, or waits for an engine process: off the loop
