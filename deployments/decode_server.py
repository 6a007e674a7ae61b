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
pages, and cancels the prefill call, which frees prefill's. A failed prefill
call or transfer ends the request with an error output.

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

from deployments.admission import queue_timeout_s
from deployments.app_config import AppConfig
from deployments.decode_thread import DecodeThread, Reserved, error_output
from deployments.metrics.replica import DecodeMetrics
from deployments.replica_server import ReplicaServer
from deployments.replica_build import build_decode_worker
from deployments.router import PromptKeys
from deployments.stream_pacing import StreamPacer, paced_outputs
from workers.engine import RequestOutput
from workers.prefill_worker import PrefillResult, PrefillTask
from workers.request import Request
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
        self.pacer = StreamPacer(cfg.decode.stream_items_per_s)
        self.prompt_keys = None if prefill is None else PromptKeys(cfg, "prefill", model_dir)  # the prefill router's
        self.worker_id = f"decode-{serve.get_replica_context().replica_id.unique_id}"
        worker = await asyncio.to_thread(build_decode_worker, cfg, model_dir, self.worker_id)
        thread = DecodeThread(worker, self.worker_id, queue_timeout_s(cfg))
        extra = {} if prefill is None else {"warmup_page": thread.warmup_page}
        metrics = DecodeMetrics(cfg.model_name, cfg.decode.mtp_draft_tokens)
        self.offer = await self._start(thread, worker, "decode", metrics, directory, extra)
        # Ready = able to serve: at least one prefill replica handshaked (and
        # warmed up by it), unless prefill takes unusually long to come up.
        if prefill is not None and not await self.sync.wait_for_peer(PEER_WAIT_S):
            log.warning("decode %s: no prefill replica after %.0fs; serving anyway", self.agent, PEER_WAIT_S)

    async def _learn(self, entry: dict[str, Any]) -> None:
        await self.thread.call(self.thread.learn_peer, entry["offer"])

    # -------------------------------------------------------------- requests
    async def _await_prefill(self, task: PrefillTask, response) -> None:
        """Hand the prefill replica's answer (or its failure) to the engine."""
        agent = None
        try:
            agent, result = await response
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the prefill replica died or raised: this request fails
            result = PrefillResult(task.request_id, False, error=f"prefill call failed: {e}")
        self.thread.post(self.thread.prefill_result, result, agent)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       prefix_keys: list[int] | None = None, admit_by: float | None = None) -> AsyncIterator[tuple]:
        """Stream the request's outputs as `RequestOutput.to_wire` tuples (see the
        module doc); the last one has ``finished`` set. ``admit_by``: wall-clock time by which the
        request must have started here and at prefill, else it is refused (``deployments.admission``).
        ``prefix_keys``: the prompt's page keys, for the decode router (`deployments.router`)."""
        start = time.monotonic()
        stream = self.thread.open_stream(request_id)
        prefill_call = None
        finished = False
        self.pacer.open()
        try:
            if self.prefill is None:
                # Monolithic: the engine prefills the prompt itself; a refusal is the stream's first output.
                self.thread.post(self.thread.add, Request(request_id, list(prompt), params), admit_by)
            else:
                if not self.sync.known:
                    await self.sync.wait_for_peer(PEER_WAIT_S)
                self.thread.post(self.thread.reserve, Request(request_id, list(prompt), params), admit_by)
                item = await stream.get()
                if isinstance(item, RequestOutput):  # refused before any page was taken
                    finished = True
                    self.metrics.finished(item)
                    yield item.to_wire()
                    return
                assert isinstance(item, Reserved)
                task = PrefillTask(request_id, list(prompt), params, self.agent, item.pages, item.cached_pages)
                prefill_call = self.prefill.prefill.remote(
                    task, self.offer, known_prefills=tuple(sorted(self.sync.known)),
                    prefix_keys=self.prompt_keys(prompt),
                    admit_by=admit_by)
                waiter = asyncio.create_task(self._await_prefill(task, prefill_call))
            first = True
            async for out in paced_outputs(stream, self.pacer):
                if out.token_ids:
                    if first:
                        first = False
                        self.metrics.first_token(time.monotonic() - start, len(prompt))
                    self.metrics.tokens(len(out.token_ids))
                finished = out.finished
                if finished:
                    self.metrics.finished(out)
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
            self.thread.post(self.thread.abort, request_id)  # no-op when it finished
            if prefill_call is not None and not waiter.done():
                # Serve cancels the call on the prefill replica, which aborts
                # the prefill and frees its pages.
                prefill_call.cancel()
                waiter.cancel()
            self.thread.close_stream(request_id)
