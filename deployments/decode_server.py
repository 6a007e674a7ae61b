"""The decode deployment: one replica = one `DecodeWorker` on its worker thread; it
orchestrates each request (DESIGN.md, request path).

`generate` (streamed, routed here by `deployments.router.DecodeRouter`):

1. hold ``ceil(prompt / 64)`` pages: the prompt's cached prefix from this replica's
   prefix cache, then fresh pages, and open an any-peer receive for the fresh ones;
2. call the prefill deployment (its router picks the least loaded prefill
   replica this replica has handshaked with) with the task: request id,
   token ids, sampling params, this agent's name and offer, the fresh page ids
   and how many leading pages it holds (prefill pushes only the rest);
3. hand prefill's answer (first token, last hidden state) to the engine;
   the request joins the running batch once its pages have landed;
4. yield every `RequestOutput` until the request finishes, as
   `RequestOutput.to_wire` tuples (cheap for Ray to serialize), spaced by
   `deployments.stream_pacing.StreamPacer` (``decode.stream_items_per_s``).

A cancelled call (client disconnect: Serve cancels the ingress request and
its calls here) aborts the request on the worker thread, which frees its
pages, and cancels the prefill call, which frees prefill's. A prefill replica
that dies before the first token costs the request one retry on another
prefill replica (`retry_id`); a second fault, a failed transfer or a prefill
call that raised ends the request with an error output (a fault's error is
marked `workers.request.UNAVAILABLE`: 503 at the ingress).

In monolithic mode (no ``prefill`` handle; the worker has no NIXL agent)
steps 1-3 are one: the worker thread hands the request to the engine, which
prefills it in chunks between decode steps; the replica waits for no peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from ray import serve
from ray.exceptions import RayActorError

from deployments.app_config import AppConfig
from deployments.decode_thread import Reserved, error_output
from deployments.metrics import hop_trace
from deployments.metrics.replica import DecodeMetrics
from deployments.replica_server import ReplicaServer
from deployments.worker_thread import ENGINE_FAILED
from deployments.router import PromptKeys
from deployments.stream_pacing import StreamPacer, paced_outputs
from workers.engine import RequestOutput
from workers.prefill_worker import PrefillResult, PrefillTask
from workers.request import FinishReason, Request, unavailable
from workers.sample.params import SamplingParams

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console

PEER_WAIT_S = 300.0
"""How long a new decode replica waits for a prefill peer before it reports ready anyway."""


class DecodeServer(ReplicaServer):
    async def __init__(self, app_args: dict[str, Any], model_dir: str, directory, prefill=None):
        """``prefill``: the prefill deployment's handle; None in monolithic mode."""
        cfg = AppConfig.model_validate(app_args)
        if cfg.monolithic != (prefill is None):
            raise ValueError(f"mode {cfg.mode!r} with{'out' if prefill is None else ''} a prefill deployment")
        self.prefill = prefill
        self._streams: dict[str, Any] = {}  # attempt id -> its stream from the worker thread
        self.retryable: set[str] = set()  # attempts whose prefill replica died (`_await_prefill`)
        self.pacer = StreamPacer(cfg.decode.stream_items_per_s)
        self.prompt_keys = None if prefill is None else PromptKeys(cfg, "prefill", model_dir)  # the prefill router's
        self.worker_id = f"decode-{serve.get_replica_context().replica_id.unique_id}"
        thread = await self._open_engine("decode", cfg, app_args, model_dir, error_output)
        extra = {} if prefill is None else {"warmup_page": thread.warmup_page}
        metrics = DecodeMetrics(cfg.model_name, cfg.decode.mtp_draft_tokens)
        self.offer = await self._start(thread, "decode", metrics, directory, extra, cfg.decode.gil_switch_interval_ms)
        # Ready = able to serve: at least one prefill replica handshaked (and
        # warmed up by it), unless prefill takes unusually long to come up.
        if prefill is not None and not await self.sync.wait_for_peer(PEER_WAIT_S):
            log.warning("decode %s: no prefill replica after %.0fs; serving anyway", self.agent, PEER_WAIT_S)

    async def _learn(self, entry: dict[str, Any]) -> None:
        await self.thread.call(self.thread.learn_peer, entry["offer"])

    # -------------------------------------------------------------- requests
    async def _await_prefill(self, task: PrefillTask, response) -> None:
        """Hand the prefill replica's answer (or its failure) to the engine. A replica that died (or
        that Serve could not reach), or whose engine failed, marks the attempt for one retry (``self.retryable``)."""
        agent = None
        try:
            agent, result = await response
        except asyncio.CancelledError:
            raise
        except RayActorError as e:  # the prefill replica died mid-task: a fault, not the request's
            self.retryable.add(task.request_id)
            result = PrefillResult(task.request_id, False, error=unavailable(f"the prefill replica died: {e}"))
        except Exception as e:  # noqa: BLE001 - the prefill replica raised: this request fails
            result = PrefillResult(task.request_id, False, error=f"prefill call failed: {e}")
        else:
            if not result.ok and (result.error or "").startswith(unavailable(ENGINE_FAILED)):
                # Its engine (thread or process) failed under the replica: as if the replica had died.
                self.retryable.add(task.request_id)
        self.thread.post(self.thread.prefill_result, result, agent)

    async def _start_pd(self, attempt_id: str, prompt: list[int], params: SamplingParams,
                        admit_by: float | None) -> tuple[Any, Any, RequestOutput | None]:
        """Reserve pages for one attempt at ``prompt`` and call a prefill replica for it. Returns
        (the prefill call, the task awaiting its answer, None), or (None, None, the refusal) when
        decode refused the attempt before taking a page."""
        self.thread.post(self.thread.reserve, Request(attempt_id, list(prompt), params), admit_by)
        item = await self._streams[attempt_id].get()
        if isinstance(item, RequestOutput):
            return None, None, item
        assert isinstance(item, Reserved)
        task = PrefillTask(attempt_id, list(prompt), params, self.agent, item.pages, item.cached_pages)
        call = self.prefill.prefill.remote(
            task, self.offer, known_prefills=tuple(sorted(self.sync.known)),
            prefix_keys=self.prompt_keys(prompt), admit_by=admit_by)
        return call, asyncio.create_task(self._await_prefill(task, call)), None

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       prefix_keys: list[int] | None = None, admit_by: float | None = None) -> AsyncIterator[tuple]:
        """Stream the request's outputs as `RequestOutput.to_wire` tuples (see the
        module doc); the last one has ``finished`` set. ``admit_by``: wall-clock time by which the
        request must have started here and at prefill, else it is refused (``deployments.admission``).
        ``prefix_keys``: the prompt's page keys, for the decode router (`deployments.router`).

        A prefill replica that dies before the first token costs the request one retry, on another
        prefill replica, as a new attempt (`retry_id`: new pages, a new receive; the dead attempt's
        pages stay held until no WRITE of it can land). A second fault ends it with the error."""
        start = time.monotonic()
        hop_trace.mark(request_id, "decode.entered")
        attempt_id = request_id
        self._streams[attempt_id] = self.thread.open_stream(attempt_id)
        prefill_call = waiter = None
        finished = False
        self.pacer.open()
        try:
            if self.prefill is None:
                # Monolithic: the engine prefills the prompt itself; a refusal is the stream's first output.
                self.thread.post(self.thread.add, Request(request_id, list(prompt), params), admit_by)
                first = None
            else:
                if not self.sync.known:
                    await self.sync.wait_for_peer(PEER_WAIT_S)
                prefill_call, waiter, first = await self._start_pd(attempt_id, prompt, params, admit_by)
                if first is None:
                    first = await self._streams[attempt_id].get()
                    if first.finish_reason == FinishReason.ERROR.value and attempt_id in self.retryable:
                        log.warning("decode %s: request %s lost its prefill replica; retrying once: %s",
                                    self.agent, request_id, first.error)
                        self.metrics.retried("prefill_died")
                        self._end_attempt(attempt_id, prefill_call, waiter)
                        attempt_id = retry_id(request_id)
                        self._streams[attempt_id] = self.thread.open_stream(attempt_id)
                        # Admitted once already: the retry is not refused for the time it lost.
                        prefill_call, waiter, first = await self._start_pd(attempt_id, prompt, params, None)
                        if first is None:
                            first = await self._streams[attempt_id].get()
            first_token = True
            async for out in paced_outputs(self._streams[attempt_id], self.pacer, first):
                if out.token_ids:
                    if first_token:
                        first_token = False
                        self.metrics.first_token(time.monotonic() - start, len(prompt))
                    self.metrics.tokens(len(out.token_ids))
                finished = out.finished
                if finished:
                    self.metrics.finished(out)
                hop_trace.mark(request_id, "decode.yielded")
                yield out.to_wire()
        except asyncio.CancelledError:
            log.info("decode %s: request %s cancelled", self.agent, request_id)
            raise
        except Exception as e:  # noqa: BLE001 - report, then clean up below
            log.exception("decode %s: request %s failed", self.agent, request_id)
            if not finished:
                finished = True
                yield error_output(request_id, f"decode failed: {e}").to_wire()
        finally:
            self.pacer.close()
            self._end_attempt(attempt_id, prefill_call, waiter)

    def _end_attempt(self, attempt_id: str, prefill_call, waiter) -> None:
        """Abort ``attempt_id`` here (a no-op when it finished) and at prefill, and close its stream."""
        self.thread.post(self.thread.abort, attempt_id)
        if prefill_call is not None and not waiter.done():
            # Serve cancels the call on the prefill replica, which aborts
            # the prefill and frees its pages.
            prefill_call.cancel()
            waiter.cancel()
        self.retryable.discard(attempt_id)
        self._streams.pop(attempt_id, None)
        self.thread.close_stream(attempt_id)


def retry_id(request_id: str) -> str:
    """The id of a request's second attempt: a new id, since a receiver never reuses one (a late
    notification of the dead attempt must not complete the new one)."""
    return f"{request_id}~retry"
