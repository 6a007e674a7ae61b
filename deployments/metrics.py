"""Serving metrics, through ``ray.serve.metrics``.

Serve tags every series with its application, deployment and replica and
exports it on Ray's Prometheus endpoint (each node's metrics export port,
scraped by the chart's monitors), so no replica opens a port of its own.
Per-request timings are taken in the decode replica, which sees every token
leave: time to first token counts from the moment decode accepted the request
(page reservation and prefill included), inter-token latency is the gap
between consecutive engine outputs (with MTP one output may carry several
tokens). KV push figures are taken in the prefill replica, which pushes, as
each prefill call returns (a push its decode caller cancelled is not
counted). Page-pool gauges and MTP counters follow each replica's heartbeat
snapshot (`deployments.peer_sync`).
"""

from __future__ import annotations

import logging
from ray.serve import metrics

from deployments.replica_stats import DecodeStats, ReplicaStats

_LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
# A DeepSeek-V3.2 8k prompt's pages copy in 0.3 ms on one H100, 1 ms between NVLink H200s.
_PUSH_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0]


class RoleMetrics:
    """Gauges every replica of a role reports from its load snapshot."""

    def __init__(self, role: str):
        self.role = role
        self.free_pages = metrics.Gauge("dsa_pd_free_pages", "Free KV cache pages of the replica's pool.",
                                        tag_keys=("role",))
        self.total_pages = metrics.Gauge("dsa_pd_total_pages", "KV cache pages of the replica's pool.",
                                         tag_keys=("role",))
        self.queue_depth = metrics.Gauge("dsa_pd_queue_depth",
                                         "Requests waiting in the replica (for pages, KV or a batch slot).",
                                         tag_keys=("role",))
        for m in (self.free_pages, self.total_pages, self.queue_depth):
            m.set_default_tags({"role": role})
        self._warned = False

    def update(self, stats: ReplicaStats) -> None:
        """Set the gauges from a load snapshot (`safe_update` when a failure must not propagate)."""
        self.free_pages.set(stats.free_pages)
        self.total_pages.set(stats.total_pages)
        self.queue_depth.set(stats.waiting)

    def safe_update(self, stats: ReplicaStats) -> None:
        """`update`, logging instead of raising: metrics must never stop the heartbeat that carries the stats."""
        self._safely(self.update, stats)

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                logging.getLogger("ray.serve").warning("dsa-pd metrics update failed: %r", e)


class PrefillMetrics(RoleMetrics):
    """Page-pool gauges plus the KV pushes of a prefill replica."""

    def __init__(self):
        super().__init__("prefill")
        self.push_bytes = metrics.Counter("dsa_pd_kv_push_bytes", "Bytes of KV, indexer and state pages pushed "
                                          "to decode by completed pushes.")
        self.pushes = metrics.Counter("dsa_pd_kv_pushes", "Pushes ended, by status (done, failed, expired).",
                                      tag_keys=("status",))
        self.push_tail = metrics.Histogram("dsa_pd_kv_push_tail_seconds",
                                           "Transfer time after a prompt's last forward: from posting its last "
                                           "chunk's pages to the end of its push.", boundaries=_PUSH_BUCKETS_S)

    def observe_push(self, result) -> None:
        """Record a `workers.prefill_worker.PrefillResult`'s push (nothing if it never began)."""
        if not result.push_status:
            return
        self.pushes.inc(tags={"status": result.push_status})
        if result.push_status == "done":
            if result.push_nbytes:
                self.push_bytes.inc(result.push_nbytes)
            self.push_tail.observe(result.push_tail_s)

    def safe_observe_push(self, result) -> None:
        """`observe_push`, logging instead of raising: metrics must never fail a request."""
        self._safely(self.observe_push, result)


class DecodeMetrics(RoleMetrics):
    """Token and latency metrics of a decode replica, plus MTP acceptance."""

    def __init__(self):
        super().__init__("decode")
        self.tokens = metrics.Counter("dsa_pd_generated_tokens", "Tokens generated (sent to clients).")
        self.requests = metrics.Counter("dsa_pd_requests", "Requests finished, by finish reason.",
                                        tag_keys=("finish_reason",))
        self.ttft = metrics.Histogram("dsa_pd_time_to_first_token_seconds",
                                      "From decode accepting a request to its first token.",
                                      boundaries=_LATENCY_BUCKETS_S)
        self.itl = metrics.Histogram("dsa_pd_inter_token_latency_seconds",
                                     "Gap between consecutive outputs of one request.",
                                     boundaries=_LATENCY_BUCKETS_S)
        self.mtp_drafted = metrics.Counter("dsa_pd_mtp_draft_tokens", "MTP draft tokens proposed.")
        self.mtp_accepted = metrics.Counter("dsa_pd_mtp_accepted_tokens", "MTP draft tokens accepted.")
        self.mtp_rate = metrics.Gauge("dsa_pd_mtp_acceptance_rate", "Accepted / drafted MTP tokens so far.")
        self._last_drafted = self._last_accepted = 0

    def update(self, stats: DecodeStats) -> None:
        super().update(stats)
        drafted, accepted = stats.mtp_drafted, stats.mtp_accepted
        # Counters only take positive increments (a step may accept no draft).
        if drafted > self._last_drafted:
            self.mtp_drafted.inc(drafted - self._last_drafted)
        if accepted > self._last_accepted:
            self.mtp_accepted.inc(accepted - self._last_accepted)
        self._last_drafted, self._last_accepted = drafted, accepted
        self.mtp_rate.set(stats.mtp_acceptance_rate)
