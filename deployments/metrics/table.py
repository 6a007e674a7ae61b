"""The one table of dsa-pd's metrics: names, types, labels, buckets, where each is measured.

Both the exporters (`deployments.metrics.exporters`, which register these
with ``ray.serve.metrics``) and the dashboard generator
(`deployments.metrics.dashboards`) read it, so a dashboard cannot ask for a
series that no replica exports, and docs/serving.md's metrics table is
checked against it (tests/deployments/test_metrics_table.py).

Names are registered as ``dsa_pd_*``; Ray's Prometheus endpoint prefixes
``ray_`` and, for counters, appends ``_total`` (`MetricSpec.prom`). Serve adds
its own labels to every series: ``application``, ``deployment`` and
``replica`` (the labels below are ours; the dashboards template on ``model``
and ``replica``). This module imports nothing from Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

PROM_PREFIX = "ray_"
"""What Ray's exporter puts before every application metric name."""

ROLES = ("prefill", "decode")

# ------------------------------------------------------------- label values
OUTCOMES = ("stop", "length", "error", "cancelled")
"""``outcome`` of an ingress request: the two OpenAI finish reasons, an error answer, or a client that left."""
ERROR_TYPES = ("invalid_request_error", "context_length_exceeded", "model_not_found", "overloaded", "unavailable",
               "server_error")
"""``error_type`` of an ingress request that ended with an error: the OpenAI error's ``code`` if it has one,
else its ``type``; ``none`` for every other outcome."""
STEP_KINDS = ("prefill", "decode", "verify")
"""``kind`` of an engine step: ``prefill`` ran a prefill chunk (in monolithic mode decode rows may ride along),
``decode`` one token per running request, ``verify`` an MTP draft phase and its ``k + 1``-token verify."""
PUSH_STATUSES = ("done", "failed", "expired")
"""``status`` of a finished KV push (`transfer.PushStatus`); a push whose decode caller cancelled it never
returns to the replica, so it is not counted."""
REJECTION_REASONS = {"decode": ("pages", "queue_timeout"),
                     "prefill": ("pages", "handshake", "unknown_peer", "queue_timeout")}
"""``reason`` a replica refused a request: ``pages`` (its page pool cannot hold the prompt and nothing
running will free enough), ``queue_timeout`` (it had not started by its ``admit_by`` time: waited past
``limits.queue_timeout_s``, answered 429; deployments/admission.py), ``handshake`` (the caller's NIXL
offer was refused), ``unknown_peer`` (the router picked a prefill replica the decode caller has not
handshaked with)."""
RETRY_REASONS = ("prefill_died",)
"""``reason`` a decode replica sent a request's prefill again: ``prefill_died`` (the prefill replica died
before the first token; the request's one retry, as a new attempt on another prefill replica)."""
PREEMPTION_REASONS = ("pages",)
"""``reason`` a running request was preempted: ``pages`` (no free page for its next tokens)."""
ROUTER_OUTCOMES = ("least_loaded", "prefix_cache", "round_robin", "no_replica")
"""``outcome`` of a routing decision: the first-ranked replica was the least loaded (``least_loaded``), one
that holds more of the prompt's prefix in its cache than the least loaded (``prefix_cache``: policy
``cache_aware``), the next in turn (``round_robin``), or no replica was eligible (``no_replica``)."""
ROUTER_TARGETS = ("decode", "prefill")

# ------------------------------------------------------------------ buckets
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
"""Time to first token: a short prompt's tens of ms up to a 128k-token prompt on a loaded pool (minutes)."""
E2E_BUCKETS_S = TTFT_BUCKETS_S + (1280.0, 2560.0)
"""Whole requests: TTFT plus up to tens of thousands of tokens."""
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                   0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Per-token gaps (ITL, TPOT): an H100 decode step is 2-200 ms (docs/perf.md); a CPU step tens of ms; a stall seconds."""
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Engine steps: a graphed decode step (ms) up to a long prefill chunk on the CPU reference backend (s)."""
PUSH_TAIL_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0, 5.0, 30.0)
"""Transfer after a prompt's last forward: an 8k DeepSeek-V3.2 prompt's pages copy in 0.3 ms on one H100 and
1.2 ms between NVLink H200s (docs/perf.md); a CPU (TCP) push takes ms."""
PUSH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                  120.0, 300.0, 600.0)
"""A whole push, from the task's admission to its end: it spans every chunk's forward of a long prompt."""
PROMPT_LEN_BUCKETS = tuple(float(2 ** i) for i in range(3, 19))  # 8 .. 262144 tokens
GEN_LEN_BUCKETS = tuple(float(2 ** i) for i in range(0, 16))  # 1 .. 32768 tokens


@dataclass(frozen=True)
class MetricSpec:
    """One metric: what it is called, what it measures, where and with which labels."""

    name: str
    """As registered with Ray (``dsa_pd_*``)."""
    kind: Kind
    description: str
    labels: tuple[str, ...]
    """Our labels; Serve adds ``application``, ``deployment``, ``replica``."""
    where: str
    """The component that records it: ``ingress``, ``decode``, ``prefill``, ``prefill, decode`` or ``router``."""
    buckets: tuple[float, ...] = ()
    """Histogram upper bounds (``le``), seconds or tokens; empty for counters and gauges."""

    def __post_init__(self) -> None:
        if not self.name.startswith("dsa_pd_"):
            raise ValueError(f"{self.name}: every dsa-pd metric is named dsa_pd_*")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms, and only they, have buckets")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"{self.name}: buckets must increase")

    @property
    def prom(self) -> str:
        """The series name Prometheus stores (histograms: add ``_bucket`` / ``_sum`` / ``_count``)."""
        return PROM_PREFIX + self.name + ("_total" if self.kind == "counter" else "")


def _m(name: str, kind: Kind, labels: tuple[str, ...], where: str, description: str,
       buckets: tuple[float, ...] = ()) -> MetricSpec:
    return MetricSpec(name, kind, description, labels, where, buckets)


_SPECS = (
    # ---- ingress: every request, end to end (tokenization, routing, queueing, the prefill hop and the KV push included)
    _m("dsa_pd_requests", "counter", ("model", "outcome", "error_type"), "ingress",
       "Requests answered by the ingress, by outcome (stop, length, error, cancelled) and error type."),
    _m("dsa_pd_request_ttft_seconds", "histogram", ("model",), "ingress",
       "End-to-end time to first token: from the request's arrival at the ingress to its first token there.",
       TTFT_BUCKETS_S),
    _m("dsa_pd_request_tpot_seconds", "histogram", ("model",), "ingress",
       "Time per output token after the first, per request: (last token - first token) / (tokens - 1).",
       TOKEN_BUCKETS_S),
    _m("dsa_pd_request_itl_seconds", "histogram", ("model",), "ingress",
       "Inter-token latency: the gap between consecutive outputs of one request at the ingress (an output may "
       "carry several tokens: MTP, or steps merged when the event loop lags).", TOKEN_BUCKETS_S),
    _m("dsa_pd_request_e2e_seconds", "histogram", ("model",), "ingress",
       "End-to-end latency of a finished request: arrival at the ingress to its last token.", E2E_BUCKETS_S),
    _m("dsa_pd_request_prompt_tokens", "histogram", ("model",), "ingress",
       "Prompt length of each admitted request, in tokens.", PROMPT_LEN_BUCKETS),
    _m("dsa_pd_request_generation_tokens", "histogram", ("model",), "ingress",
       "Tokens generated for each finished request.", GEN_LEN_BUCKETS),
    # ---- replicas of both roles
    _m("dsa_pd_prompt_tokens", "counter", ("role", "model"), "prefill, decode",
       "Prompt tokens: computed by prefill replicas (counted per chunk as it is computed); taken in by decode "
       "replicas (counted when a request's prompt is in its pages: pushed KV landed, or prefilled locally in "
       "monolithic mode)."),
    _m("dsa_pd_generated_tokens", "counter", ("role", "model"), "prefill, decode",
       "Generated tokens: streamed by decode replicas (token 1 included); sampled by prefill replicas (token 1 "
       "of each prompt, which decode streams)."),
    _m("dsa_pd_running_requests", "gauge", ("role", "model"), "prefill, decode",
       "Running batch: requests being prefilled (prefill) or in the decode batch or prefilling (decode)."),
    _m("dsa_pd_queue_depth", "gauge", ("role", "model"), "prefill, decode",
       "Requests waiting in the replica: for pages (both roles), for their KV or for a batch slot (decode)."),
    _m("dsa_pd_pages_used", "gauge", ("role", "model"), "prefill, decode",
       "Pages of the replica's page pool in use (running, reserved, held until prefill settles, the warm-up page; "
       "not the prefix cache's unreferenced pages, which are reclaimable)."),
    _m("dsa_pd_pages_total", "gauge", ("role", "model"), "prefill, decode",
       "Pages of the replica's page pool."),
    _m("dsa_pd_engine_step_seconds", "histogram", ("role", "model", "kind"), "prefill, decode",
       "Wall time of one engine step that computed, by kind (prefill, decode, verify): the worker thread's "
       "forward(s), sampling and read-back.", STEP_BUCKETS_S),
    _m("dsa_pd_rejections", "counter", ("role", "model", "reason"), "prefill, decode",
       "Requests a replica refused (pages, queue_timeout: answered 429 overloaded), by reason."),
    _m("dsa_pd_prefix_cache_queries", "counter", ("role", "model"), "prefill, decode",
       "Prompt tokens looked up in the replica's prefix cache (workers/prefix_cache.py) by the requests it "
       "admitted: prefill tasks, decode reservations (pd) and local prefills (monolithic), re-prefills included."),
    _m("dsa_pd_prefix_cache_hits", "counter", ("role", "model"), "prefill, decode",
       "Of those, prompt tokens found cached (full 64-token pages): not computed again, and on decode not pushed "
       "again. The hit rate is hits / queries."),
    _m("dsa_pd_prefix_cache_pages", "gauge", ("role", "model"), "prefill, decode",
       "Pages the replica's prefix cache holds (shared by running requests, or unreferenced: reclaimable, "
       "counted as free in dsa_pd_pages_used)."),
    _m("dsa_pd_prefix_cache_evictions", "counter", ("role", "model"), "prefill, decode",
       "Cached pages evicted (least recently used first) because the pool needed free pages."),
    _m("dsa_pd_preemptions", "counter", ("role", "model", "reason"), "decode",
       "Running requests preempted (their pages freed, re-prefilled later), by reason."),
    _m("dsa_pd_retries", "counter", ("role", "model", "reason"), "decode",
       "Requests whose prefill a decode replica sent again, by reason (prefill_died: the prefill replica died "
       "before the first token). A request is retried at most once; a second fault answers 503."),
    # ---- decode only
    _m("dsa_pd_decode_ttft_seconds", "histogram", ("model",), "decode",
       "Decode-side time to first token: from the decode replica accepting the request to its first token "
       "(page reservation, the prefill call and the KV push included; the ingress and routing before it not).",
       TTFT_BUCKETS_S),
    _m("dsa_pd_mtp_draft_tokens", "counter", ("model",), "decode", "MTP draft tokens proposed."),
    _m("dsa_pd_mtp_accepted_tokens", "counter", ("model",), "decode", "MTP draft tokens accepted."),
    _m("dsa_pd_mtp_accepted_length", "counter", ("model", "length"), "decode",
       "MTP verify steps of one request by how many of its drafts were accepted (length 0 .. k): the "
       "accepted-length histogram."),
    # ---- prefill only: the KV push (prefill -> decode NIXL WRITEs)
    _m("dsa_pd_kv_push_bytes", "counter", ("model",), "prefill",
       "Bytes of KV, indexer and state pages written to decode by completed pushes (its rate: push throughput)."),
    _m("dsa_pd_kv_pushes", "counter", ("model", "status"), "prefill",
       "Pushes ended, by status (done, failed, expired)."),
    _m("dsa_pd_kv_push_seconds", "histogram", ("model",), "prefill",
       "A whole push, from admitting the prefill task to the end of its last WRITE (spans the prompt's chunks).",
       PUSH_BUCKETS_S),
    _m("dsa_pd_kv_push_tail_seconds", "histogram", ("model",), "prefill",
       "Transfer time after a prompt's last forward: from posting its last chunk's pages to the end of its "
       "push (what the first token waits for).", PUSH_TAIL_BUCKETS_S),
    # ---- routers (in the process holding the handle: the ingress for decode, decode replicas for prefill)
    _m("dsa_pd_router_decisions", "counter", ("model", "target", "policy", "outcome"), "router",
       "Routing decisions of the request routers, by target deployment (decode, prefill), policy and outcome. "
       "Serve asks again while every replica is full, so one request may count more than once."),
)

METRICS: dict[str, MetricSpec] = {s.name: s for s in _SPECS}
"""Every dsa-pd metric, by registered name."""


def spec(name: str) -> MetricSpec:
    """The spec of ``name`` (KeyError names it: a typo fails where the metric is made, not silently)."""
    return METRICS[name]


def prom(name: str) -> str:
    """``spec(name).prom``: the Prometheus series name, for the dashboards."""
    return METRICS[name].prom
