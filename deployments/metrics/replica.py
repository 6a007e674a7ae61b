"""What prefill and decode replicas record (`PrefillMetrics`, `DecodeMetrics`).

Gauges (running batch, queue, pages) and the engine's cumulative counters
(MTP drafts and acceptances, preemptions) follow the replica's load snapshot
at each heartbeat of `deployments.peer_sync` (twice a second); engine steps
arrive as `StepRecord` s taken from the worker thread at the same time. Per
request figures are recorded by the deployment's request handler: the KV push
when a prefill call returns (in the prefill replica, which pushes), the
decode-side time to first token and the tokens streamed in the decode
replica. Every method logs instead of raising (`never_raises`). With
``DSA_PD_STEP_TRACE`` set, the steps also go to a JSONL trace
(`deployments.metrics.step_trace`).
"""

from __future__ import annotations

from typing import Iterable

from deployments.admission import overload_reason
from deployments.metrics.series import Series, never_raises
from deployments.metrics.step_trace import StepTrace
from deployments.metrics.table import PREEMPTION_REASONS, PUSH_STATUSES, REJECTION_REASONS, RETRY_REASONS
from deployments.replica_stats import DecodeStats, PrefillStats, ReplicaStats, StepRecord


class ReplicaMetrics:
    """The series every replica of ``role`` records."""

    def __init__(self, role: str, model: str):
        self.role, self.model = role, model
        tags = {"role": role, "model": model}
        self.prompt_tokens = Series("dsa_pd_prompt_tokens", tags)
        self.generated_tokens = Series("dsa_pd_generated_tokens", tags)
        self.running = Series("dsa_pd_running_requests", tags)
        self.queue_depth = Series("dsa_pd_queue_depth", tags)
        self.pages_used = Series("dsa_pd_pages_used", tags)
        self.pages_total = Series("dsa_pd_pages_total", tags)
        self.step_seconds = Series("dsa_pd_engine_step_seconds", tags)
        self.rejections = Series("dsa_pd_rejections", tags)
        self.cache_queries = Series("dsa_pd_prefix_cache_queries", tags)
        self.cache_hits = Series("dsa_pd_prefix_cache_hits", tags)
        self.cache_pages = Series("dsa_pd_prefix_cache_pages", tags)
        self.cache_evictions = Series("dsa_pd_prefix_cache_evictions", tags)
        for counter in (self.prompt_tokens, self.generated_tokens, self.cache_queries, self.cache_hits,
                        self.cache_evictions):
            counter.zero()
        for reason in REJECTION_REASONS[role]:
            self.rejections.zero(reason=reason)
        self._cache_last = (0, 0, 0)
        self.trace = StepTrace.from_env(role)

    @never_raises
    def update(self, stats: ReplicaStats, steps: Iterable[StepRecord] = ()) -> None:
        """Record a heartbeat: the load snapshot and the engine steps since the last one."""
        self.pages_total.set(stats.total_pages)
        self.pages_used.set(stats.total_pages - stats.free_pages)
        self.queue_depth.set(stats.waiting)
        self.running.set(self._running(stats))
        self.cache_pages.set(stats.cached_pages)
        # The prefix cache's counts are cumulative: the counters take what grew since the last snapshot.
        now = (stats.prefix_queries, stats.prefix_hits, stats.prefix_evictions)
        for series, value, last in zip((self.cache_queries, self.cache_hits, self.cache_evictions), now,
                                       self._cache_last):
            series.inc(value - last)
        self._cache_last = now
        steps = list(steps)
        for step in steps:
            self._step(step)
        if self.trace is not None:
            self.trace.write(steps)

    def _running(self, stats: ReplicaStats) -> int:
        raise NotImplementedError

    def _step(self, step: StepRecord) -> None:
        self.step_seconds.observe(step.seconds, kind=step.kind)

    @never_raises
    def reject(self, reason: str) -> None:
        """A request this replica refused (``reason``: one of `REJECTION_REASONS` of the role)."""
        self.rejections.inc(reason=reason)


class PrefillMetrics(ReplicaMetrics):
    """Prefill replicas: prompt tokens per chunk, token 1 sampled, the KV pushes."""

    def __init__(self, model: str):
        super().__init__("prefill", model)
        tags = {"model": model}
        self.push_bytes = Series("dsa_pd_kv_push_bytes", tags)
        self.pushes = Series("dsa_pd_kv_pushes", tags)
        self.push_seconds = Series("dsa_pd_kv_push_seconds", tags)
        self.push_tail = Series("dsa_pd_kv_push_tail_seconds", tags)
        self.push_bytes.zero()
        for status in PUSH_STATUSES:
            self.pushes.zero(status=status)

    def _running(self, stats: PrefillStats) -> int:
        return stats.active

    def _step(self, step: StepRecord) -> None:
        super()._step(step)
        self.prompt_tokens.inc(step.tokens)

    @never_raises
    def observe_result(self, result) -> None:
        """Record a `workers.prefill_worker.PrefillResult` as its prefill call returns: the push
        (nothing if it never began), token 1 (if prefill succeeded), or the refusal."""
        if result.push_status:
            self.pushes.inc(status=result.push_status)
            if result.push_status == "done":
                self.push_bytes.inc(result.push_nbytes)
                self.push_seconds.observe(result.push_s)
                self.push_tail.observe(result.push_tail_s)
        if result.ok:
            self.generated_tokens.inc(1)
        elif not result.push_status:  # refused before its push began
            reason = _prefill_refusal(result.error)
            if reason is not None:
                self.rejections.inc(reason=reason)


def _prefill_refusal(error: str) -> str | None:
    """The rejection reason of a prefill task that never started (None: not a refusal, e.g. an abort).
    The prefixes are those `deployments.prefill_thread` and `prefill_server` answer with; an
    ``overloaded:`` refusal (`deployments.admission.overload_message`) carries its reason."""
    overload = overload_reason(error)
    if overload is not None:
        return overload[1]
    if error.startswith("prefill page pool"):
        return "pages"
    if error.startswith("handshake"):
        return "handshake"
    if error.startswith("decode has not handshaked"):
        return "unknown_peer"
    return None


class DecodeMetrics(ReplicaMetrics):
    """Decode replicas: tokens streamed, decode-side TTFT, MTP acceptance, preemptions."""

    def __init__(self, model: str, mtp_draft_tokens: int = 0):
        super().__init__("decode", model)
        tags = {"model": model}
        self.ttft = Series("dsa_pd_decode_ttft_seconds", tags)
        self.mtp_drafted = Series("dsa_pd_mtp_draft_tokens", tags)
        self.mtp_accepted = Series("dsa_pd_mtp_accepted_tokens", tags)
        self.mtp_lengths = Series("dsa_pd_mtp_accepted_length", tags)
        self.preemptions = Series("dsa_pd_preemptions", {"role": "decode", "model": model})
        # Zeros so that a deployment without MTP shows 0 drafts, not "no data".
        self.mtp_drafted.zero()
        self.mtp_accepted.zero()
        for n in range(mtp_draft_tokens + 1):
            self.mtp_lengths.zero(length=str(n))
        for reason in PREEMPTION_REASONS:
            self.preemptions.zero(reason=reason)
        self.retries = Series("dsa_pd_retries", {"role": "decode", "model": model})
        for reason in RETRY_REASONS:
            self.retries.zero(reason=reason)
        self._last: DecodeStats | None = None

    def _running(self, stats: DecodeStats) -> int:
        return stats.running

    def _step(self, step: StepRecord) -> None:
        super()._step(step)
        for n, count in enumerate(step.accepted):
            self.mtp_lengths.inc(count, length=str(n))

    @never_raises
    def update(self, stats: DecodeStats, steps: Iterable[StepRecord] = ()) -> None:
        super().update(stats, steps)
        # The engine's counters are cumulative: the counters take what grew since the last snapshot.
        last = self._last
        self.mtp_drafted.inc(stats.mtp_drafted - (last.mtp_drafted if last else 0))
        self.mtp_accepted.inc(stats.mtp_accepted - (last.mtp_accepted if last else 0))
        self.preemptions.inc(stats.preemptions - (last.preemptions if last else 0), reason="pages")
        self._last = stats

    @never_raises
    def retried(self, reason: str) -> None:
        """A request's prefill sent again (``reason``: one of `RETRY_REASONS`)."""
        self.retries.inc(1, reason=reason)

    @never_raises
    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        """A request's first token left this replica ``seconds`` after it accepted the request; its prompt
        (``prompt_tokens``) is in the replica's pages by now."""
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    @never_raises
    def tokens(self, n: int) -> None:
        """``n`` tokens streamed."""
        self.generated_tokens.inc(n)

    @never_raises
    def finished(self, out) -> None:
        """The request's last `RequestOutput`: counts this replica's refusal (for lack of pages, or past
        its queue time: the ``overloaded: decode ...`` errors `deployments.decode_thread` answers with; a
        prefill replica's refusal, passed on, is counted there)."""
        overload = overload_reason(out.error) if out.finish_reason == "error" else None
        if overload is not None and overload[0] == "decode":
            self.rejections.inc(reason=overload[1])
