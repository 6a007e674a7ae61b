"""The prefill deployment: one replica = one `PrefillWorker` on its worker thread.

Decode replicas call `prefill` (routed by `deployments.router.PrefillRouter`)
with a `PrefillTask` naming their agent and reserved pages, plus their
handshake offer for the case this replica has not met that decode epoch yet.
The call returns once every page has been pushed and the first token is
sampled. If the caller cancels the call (its client left, its transfer
expired), the prefill is aborted and its pages freed here; decode frees its
own.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from deployments.app_config import AppConfig
from deployments.metrics import hop_trace
from deployments.metrics.replica import PrefillMetrics
from deployments.replica_server import ReplicaServer
from workers.prefill_worker import PrefillResult, PrefillTask

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console


class PrefillServer(ReplicaServer):
    async def __init__(self, app_args: dict[str, Any], model_dir: str, directory):
        cfg = AppConfig.model_validate(app_args)
        self.worker_id = f"prefill-{serve.get_replica_context().replica_id.unique_id}"
        thread = await self._open_engine("prefill", cfg, app_args, model_dir,
                                         lambda rid, message: PrefillResult(rid, False, error=message))
        await self._start(thread, "prefill", PrefillMetrics(cfg.model_name), directory, {},
                          cfg.prefill.gil_switch_interval_ms)

    async def _learn(self, entry: dict[str, Any]) -> None:
        await self.thread.call(self.thread.learn_peer, entry["offer"], entry.get("extra", {}).get("warmup_page"))

    # ----------------------------------------------------------- Serve hooks
    def record_replica_metadata(self) -> dict[str, Any]:
        """Static: the agent name, so the prefill router can match it against the caller's peer book."""
        return {"agent": self.agent, "worker_id": self.worker_id}

    # -------------------------------------------------------------- requests
    async def prefill(self, task: PrefillTask, decode_offer: bytes | None = None,
                      known_prefills: tuple[str, ...] | None = None,
                      prefix_keys: list[int] | None = None, admit_by: float | None = None) -> tuple[str, PrefillResult]:
        """Prefill ``task`` and push its pages; returns ``(this agent, result)``. A task not started
        by ``admit_by`` (wall clock, `deployments.admission`) is refused ``overloaded:``.

        ``known_prefills`` / ``prefix_keys`` are for the router (it reads the
        call's keyword arguments); the agent check below only catches a
        router that routed on stale metadata.
        """
        rid = task.request_id
        hop_trace.mark(rid, "prefill.entered")
        if known_prefills is not None and self.agent not in known_prefills:
            result = PrefillResult(rid, False, error=f"decode has not handshaked with {self.agent}")
            self.metrics.observe_result(result)
            return self.agent, result
        stream = self.thread.open_stream(rid)
        done = False
        try:
            self.thread.post(self.thread.submit, task, decode_offer, admit_by)
            result = await stream.get()
            hop_trace.mark(rid, "prefill.returned")
            done = True
            self.metrics.observe_result(result)
            return self.agent, result
        finally:
            if not done:  # cancelled by decode (or the replica is shutting down)
                self.thread.post(self.thread.abort, rid)
            self.thread.close_stream(rid)
