"""The OpenAI-compatible HTTP ingress (FastAPI inside Serve).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
server-sent events or not), ``GET /v1/models``, ``GET /health`` (200 once
every role has a live replica and a decode replica has handshaked with a
prefill one — in monolithic mode, once a decode replica is up; 503 before)
and ``GET /stats`` (every replica's load figures
from the peer directory: free pages, queues, MTP counts).

The ingress tokenizes (the checkpoint's tokenizer; chat through the
checkpoint's renderer: its Jinja template, or its family's native encoder,
``deployments.openai.render``), checks the model name, the context limit and
the sampling values (answering OpenAI error objects with their status codes:
400, 404, 413; 429 with ``Retry-After`` past the limits of
``deployments.admission``, which also refuses with a 400 a request no page
pool can ever hold),
routes the request to a decode replica (`deployments.router.DecodeRouter`,
with the prompt's page keys for its cache-aware ranking) and turns the decode replica's token outputs
into text — for chat, split into ``reasoning_content``, ``content`` and
``tool_calls`` by the family's parsers (``deployments.openai.chat_output``).
It waits for the first output before answering, so a request
refused at admission still gets an error status rather than a broken stream.
A client that disconnects cancels the request: Serve cancels this handler,
and the handler cancels its decode call, which frees pages on both sides.
Every request's end-to-end timings and outcome are recorded here
(`deployments.metrics.ingress`).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route
# handlers' annotations (``request: Request``) as real types.
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from deployments import http_frontend
from deployments.admission import InFlight, PoolFit, admit_by, max_requests
from deployments.app_config import AppConfig
from deployments.auth import BearerAuth, load_api_key, set_api_key
from deployments.metrics import hop_trace
from deployments.metrics.ingress import IngressMetrics, RequestTrace
from deployments.openai.chat_output import ChatOutput
from deployments.openai.errors import (
    InvalidRequest,
    OpenAIError,
    Overloaded,
    Unavailable,
    check_model,
    check_prompt_length,
    error_from_exception,
)
from deployments.openai.limits import decode_json, read_body
from deployments.openai.logprobs import TokenText, chat_logprobs, completion_logprobs, join
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from deployments.openai.reasoning import reasoning_parser_for
from deployments.openai.render import renderer_for, resolve_settings
from deployments.openai.tools import tool_parser_for
from deployments.openai.structured import constrain_off_loop
from workers.structured import GrammarCompiler
from deployments.openai.responses import (
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    new_id,
    sse_event,
)
from deployments.replica_stats import DecodeStats
from deployments.router import PromptKeys
from deployments.text_stream import TextStream
from models.registry import load_any_config
from workers.engine import RequestOutput
from workers.request import UNAVAILABLE

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console

app = FastAPI(title="dsa-pd", description="OpenAI-compatible API of a disaggregated prefill/decode DSA model")
# Bearer-token auth when args.api_key_env is set. Added before @serve.ingress
# below: Serve serves a copy of the app frozen at decoration time.
app.add_middleware(BearerAuth)

COMPILE_THREADS = 2
"""Threads compiling new grammars (structured outputs) beside the event loop: a large schema takes up to
~100 ms; with two, one slow compile does not queue another."""

# Engine finish reasons -> OpenAI's; an aborted request never reaches a client.
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def error_response(exc: BaseException, retry_after_s: int | None = None) -> JSONResponse:
    """The OpenAI error answer of ``exc``; a 429 carries ``Retry-After`` (its own, else ``retry_after_s``)."""
    err = error_from_exception(exc)
    if err.status_code >= 500 and not isinstance(exc, OpenAIError):
        log.error("internal error answering a request", exc_info=exc)
    if isinstance(err, Overloaded) and err.retry_after_s is None:
        err.retry_after_s = retry_after_s
    return JSONResponse(err.to_response().model_dump(mode="json"), status_code=err.status_code,
                        headers=err.headers())


def output_error(out: RequestOutput) -> OpenAIError:
    """The error to answer for an engine output that ended the request with an error."""
    msg = out.error or "the request failed"
    if msg.startswith("overloaded:"):
        return Overloaded(msg.removeprefix("overloaded:").strip())
    if msg.startswith(UNAVAILABLE):
        return Unavailable(msg.removeprefix(UNAVAILABLE).strip())
    return OpenAIError(msg)


def stream_error(exc: BaseException) -> OpenAIError:
    """The error to answer when the decode call itself fails (not an error output): its replica died
    or became unreachable (503: a fault, retry), else what `error_from_exception` makes of it."""
    if isinstance(exc, RayActorError):
        return Unavailable("the decode replica serving this request died or became unreachable; "
                           "send the request again")
    return error_from_exception(exc)


class _ClientRequest:
    """One admitted request on its way out: the decode stream, its text and its counts.

    chat: a chat request's reply parser (reasoning, content, tool calls),
    None for a completion."""

    def __init__(self, kind: str, body, prompt_ids: list[int], tokenizer, trace: RequestTrace,
                 chat: ChatOutput | None = None):
        self.kind, self.body, self.prompt_len = kind, body, len(prompt_ids)
        self.prompt_ids = prompt_ids if body.return_token_ids else None  # sent back only when asked
        self.trace = trace
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.chat = chat
        self.text = chat.text if chat is not None else TextStream(tokenizer, body.stop_sequences)
        self.tokenizer = tokenizer
        self.responses = None  # the DeploymentResponseGenerator of the decode call, once made
        self.slot = None  # its place at the ingress (deployments.admission.InFlight), once admitted
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float] | None] = []  # per token; None when no top was asked
        self.prompt_logprobs: list[float | None] | None = None  # echo + logprobs: from the first output
        self.prompt_top: list[dict[int, float] | None] | None = None
        self.token_text = TokenText(tokenizer)

    @property
    def want_logprobs(self) -> bool:
        return self.body.logprobs is not None if self.kind == "completion" else bool(self.body.logprobs)

    def take(self, out: RequestOutput) -> str | ChatDelta:
        """Account an output; returns the new safe text (a chat delta for chat)."""
        self.completion_tokens += len(out.token_ids)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.top_logprobs += out.top_logprobs or [None] * len(out.token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top = out.prompt_logprobs, out.prompt_top_logprobs
        if out.finished:
            self.finish_reason = _FINISH.get(out.finish_reason or "", "stop")
            self.trace.end(self.finish_reason)  # the engine's outcome (stop, length), before "tool_calls"
            if self.chat is not None:
                delta = self.chat.push(out.token_ids, last=True)
                self.finish_reason = self.chat.finish_reason(self.finish_reason)
                return delta
            return self.text.push(out.token_ids) + self.text.finish()
        if self.chat is not None:
            return self.chat.push(out.token_ids)
        return self.text.push(out.token_ids)

    def ids(self, ids: list[int]) -> list[int] | None:
        """A response's or chunk's ``token_ids``: None (left out) unless ``return_token_ids``."""
        return list(ids) if self.body.return_token_ids else None

    @property
    def echo(self) -> bool:
        return self.kind == "completion" and self.body.echo

    def echo_text(self) -> str:
        """The prompt, returned before the completion's text with ``echo`` ("" otherwise)."""
        if not self.echo:
            return ""
        p = self.body.prompt
        return p if isinstance(p, str) else self.tokenizer.decode(p)

    def completion_logprobs(self, ids: list[int], lps: list[float], tops: list | None, offset: int,
                            with_prompt: bool = False) -> tuple[CompletionLogprobs, int]:
        """``deployments.openai.logprobs.completion_logprobs`` of these output tokens, after the
        echoed prompt's when ``with_prompt`` (the response's or the stream's first chunk)."""
        parts = []
        if with_prompt and self.echo and self.prompt_logprobs is not None:
            p = self.body.prompt
            # The ids the ingress tokenized a text prompt into (the same call, done again only here).
            prompt_ids = p if isinstance(p, list) else self.tokenizer(p)["input_ids"]
            part, offset = completion_logprobs(self.token_text, prompt_ids, self.prompt_logprobs, self.prompt_top,
                                               offset)
            parts.append(part)
        part, offset = completion_logprobs(self.token_text, ids, lps, tops, offset)
        return join(parts + [part]), offset

    def chat_logprobs(self, ids: list[int], lps: list[float], tops: list | None) -> ChatLogprobs:
        return chat_logprobs(self.token_text, ids, lps, tops)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_len, self.completion_tokens)


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, app_args: dict[str, Any], model_dir: str, decode, directory):
        from transformers import AutoTokenizer

        cfg = AppConfig.model_validate(app_args)
        set_api_key(load_api_key(cfg))  # first: no key, no start
        self.app_cfg = cfg
        self.limits = cfg.limits
        self.in_flight = InFlight(max_requests(cfg))  # deployments/admission.py
        model_cfg = load_any_config(model_dir)  # any registered architecture (models.registry)
        self.pool_fit = PoolFit.of(cfg, model_cfg)
        self.model_name = cfg.model_name
        self.max_model_len = cfg.model.max_model_len or model_cfg.max_position_embeddings
        self.vocab_size = model_cfg.vocab_size
        self.prompt_keys = PromptKeys(cfg, "decode", model_dir)  # for the decode router
        self.mode = cfg.mode
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.chat_defaults = cfg.chat
        self.renderer = renderer_for(self.tokenizer, model_cfg.arch)
        # Reasoning is split off only where the tokenizer has the think tags (real checkpoints do).
        reasoning = reasoning_parser_for(model_cfg.arch)
        vocab = self.tokenizer.get_vocab()
        self.reasoning_parser = reasoning if reasoning is not None and reasoning.end_tag in vocab else None
        self.tool_parser = tool_parser_for(model_cfg.arch)
        # Structured outputs: grammars are compiled here first (a bad one is a 400 naming its field).
        self.model_type = model_cfg.arch
        self.grammars = GrammarCompiler(self.tokenizer, model_cfg.vocab_size, model_cfg.eos_token_ids)
        # New grammars compile off the event loop (deployments.openai.structured.constrain_off_loop).
        self.compile_pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self.decode = decode.options(stream=True)
        self.directory = directory
        self.created = int(time.time())
        self.metrics = IngressMetrics(self.model_name)
        self.http_frontend = http_frontend.active()  # Ray read the same variable when this process started
        log.info(http_frontend.describe(self.http_frontend))

    # ---------------------------------------------------------------- probes
    @app.get("/health")
    async def health(self) -> JSONResponse:
        snap = await self.directory.snapshot.remote()
        prefill, decode = snap["prefill"], snap["decode"]
        if self.mode == "monolithic":  # decode replicas prefill themselves: no handshake to wait for
            ready = bool(decode)
        else:
            ready = bool(prefill) and any(DecodeStats.from_dict(d["stats"]).known_prefills > 0 for d in decode)
        body = {"status": "ok" if ready else "starting", "mode": self.mode, "prefill_replicas": len(prefill),
                "decode_replicas": len(decode)}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/stats")
    async def stats(self) -> dict[str, Any]:
        """Every prefill and decode replica's entry in the peer directory (``prefill``, ``decode``),
        and ``ingress``: the ingress replica that answered (its process id, requests in flight, the HTTP
        front end before it: ``haproxy`` or ``serve-proxy``)."""
        snap = await self.directory.snapshot.remote()
        return {**snap, "ingress": {"pid": os.getpid(), "in_flight": self.in_flight.count,
                                    "http_frontend": self.http_frontend}}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "dsa-pd", "max_model_len": self.max_model_len}]}

    # -------------------------------------------------------------- requests
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        trace = self.metrics.start()  # before reading the body: all of the request's time counts
        try:
            body: CompletionRequest = parse_request(await self._body(request), "completion")
            check_model(body.model, self.model_name)
            if isinstance(body.prompt, str):
                ids = self.tokenizer(body.prompt)["input_ids"]
            else:
                ids = list(body.prompt)
                if ids and max(ids) >= self.vocab_size:  # (max: C speed; an 8k-token prompt each request)
                    bad = next(t for t in ids if t >= self.vocab_size)
                    raise InvalidRequest(f"token id {bad} is out of the vocabulary (size {self.vocab_size})",
                                         param="prompt")
            params = await constrain_off_loop(body, self._params(body, ids, body.max_tokens, "prompt"),
                                              self.grammars, self.model_type, executor=self.compile_pool)
        except Exception as e:  # noqa: BLE001 - every refusal is an OpenAI error object
            return self._refuse(trace, e)
        return await self._run("completion", body, ids, params, trace)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        trace = self.metrics.start()
        try:
            body: ChatCompletionRequest = parse_request(await self._body(request), "chat")
            check_model(body.model, self.model_name)
            ids, chat = self._render_chat(body)
            params = await constrain_off_loop(body, self._params(body, ids, body.completion_limit, "messages"),
                                              self.grammars, self.model_type, chat, executor=self.compile_pool)
        except Exception as e:  # noqa: BLE001
            return self._refuse(trace, e)
        return await self._run("chat", body, ids, params, trace, chat)

    def _render_chat(self, body: ChatCompletionRequest) -> tuple[list[int], ChatOutput]:
        """The prompt's token ids, and the parser of the reply (``deployments.openai.render``)."""
        if self.renderer is None:
            raise InvalidRequest("this checkpoint has no chat template and its model family no native chat "
                                 "format: use /v1/completions", param="messages")
        settings = resolve_settings(body.chat_template_kwargs, body.reasoning_effort,
                                    self.chat_defaults.thinking, self.chat_defaults.drop_thinking)
        messages = body.chat_messages()
        if self.renderer.name == "jinja":
            # Templates of these models know system/user/assistant/tool; OpenAI's
            # "developer" role is the newer name for "system".
            messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        prompt = self.renderer.render(messages, body.tool_dicts(), settings)
        ids = self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        reasoning = self.reasoning_parser(prompt.thinking) if self.reasoning_parser is not None else None
        tools = self.tool_parser(body.tool_dicts()) if body.parses_tools and self.tool_parser is not None else None
        chat = ChatOutput(TextStream(self.tokenizer, body.stop_sequences), reasoning, tools,
                          include_reasoning=body.include_reasoning,
                          parallel_tool_calls=body.parallel_tool_calls is not False)
        return ids, chat

    async def _body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the body, read and parsed within ``limits`` (413 / 400 past them)."""
        data = decode_json(await read_body(request, self.limits.max_body_bytes), self.limits.max_json_depth)
        if not isinstance(data, dict):
            raise InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}")
        return data

    def _refuse(self, trace: RequestTrace, exc: BaseException) -> JSONResponse:
        """`error_response`, counted as the request's ``error`` outcome."""
        if isinstance(exc, BackPressureError):  # Serve's queue in the decode handle is full (a failsafe)
            exc = Overloaded("every decode replica is busy and Serve's queue before them is full; retry later")
        err = stream_error(exc)
        if err.status_code >= 500 and not isinstance(exc, OpenAIError) and not isinstance(err, Unavailable):
            log.error("internal error answering a request", exc_info=exc)
        trace.end("error", err)
        return error_response(err, self.limits.retry_after_s)

    def _params(self, body, ids: list[int], limit: int | None, param: str):
        if not ids:
            raise InvalidRequest(f"the {param} is empty after tokenization", param=param)
        for field, tokens in (("logit_bias", [t for t, _ in body.logit_bias_pairs()]),
                              ("stop_token_ids", body.stop_token_ids or [])):
            bad = [t for t in tokens if t >= self.vocab_size]
            if bad:
                raise InvalidRequest(f"{field}: token id {bad[0]} is out of the vocabulary (size {self.vocab_size})",
                                     param=field)
        max_new = check_prompt_length(len(ids), limit, self.max_model_len, param)
        max_new = self.pool_fit.fit(len(ids), max_new, limit is not None, param)  # 400 if it can never fit
        try:
            return body.sampling_params(max_new)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e

    async def _run(self, kind: str, body, ids: list[int], params, trace: RequestTrace,
                   chat: ChatOutput | None = None) -> Response:
        job = _ClientRequest(kind, body, ids, self.tokenizer, trace, chat)
        hop_trace.mark(job.id, "ingress.parsed")
        try:
            job.slot = self.in_flight.enter(job)  # 429 past limits.max_requests
        except Overloaded as e:
            return self._refuse(trace, e)
        trace.admitted(len(ids))
        hop_trace.mark(job.id, "ingress.dispatched")
        job.responses = self.decode.generate.remote(job.id, ids, params,
                                                    prefix_keys=self.prompt_keys(ids),
                                                    admit_by=admit_by(self.app_cfg))
        handed_over = False
        try:
            try:
                first = RequestOutput.from_wire(await job.responses.__anext__())
            except StopAsyncIteration:
                return self._refuse(trace, OpenAIError("the decode replica ended the request without output"))
            trace.output(len(first.token_ids))
            hop_trace.mark(job.id, "ingress.first_output")
            if first.finish_reason == "error":
                return self._refuse(trace, output_error(first))
            if body.stream:
                handed_over = True  # the stream owns the call from here
                events = self._completion_events(job, first) if kind == "completion" else self._chat_events(job, first)
                return StreamingResponse(events, media_type="text/event-stream")
            return await self._collect(job, first)
        except Exception as e:  # noqa: BLE001 - e.g. the decode replica died
            return self._refuse(trace, e)
        finally:
            if not handed_over:
                trace.end("cancelled")  # a no-op unless the client left before the answer
                # Finished: a no-op. Cancelled (client gone): Serve cancels the decode call.
                job.responses.cancel()
                job.slot.release()

    async def _outputs(self, job: _ClientRequest, first: RequestOutput) -> AsyncIterator[RequestOutput]:
        out = first
        while True:
            yield out
            if out.finished:
                return
            out = RequestOutput.from_wire(await job.responses.__anext__())
            job.trace.output(len(out.token_ids))

    async def _collect(self, job: _ClientRequest, first: RequestOutput) -> Response:
        async for out in self._outputs(job, first):
            if out.finish_reason == "error":
                return self._refuse(job.trace, output_error(out))
            job.take(out)
        text = job.text.text
        if job.kind == "completion":
            lp = None
            if job.want_logprobs:
                lp = job.completion_logprobs(job.token_ids, job.logprobs, job.top_logprobs, 0, with_prompt=True)[0]
            resp = CompletionResponse(id=job.id, model=self.model_name, usage=job.usage(), choices=[
                CompletionChoice(text=job.echo_text() + text, logprobs=lp, finish_reason=job.finish_reason,
                                 token_ids=job.ids(job.token_ids), prompt_token_ids=job.prompt_ids)])
        else:
            lp = job.chat_logprobs(job.token_ids, job.logprobs, job.top_logprobs) if job.want_logprobs else None
            resp = ChatCompletionResponse(id=job.id, model=self.model_name, usage=job.usage(),
                                          prompt_token_ids=job.prompt_ids, choices=[
                ChatChoice(message=job.chat.message(), logprobs=lp, finish_reason=job.finish_reason,
                           token_ids=job.ids(job.token_ids))])
        return JSONResponse(resp.model_dump(mode="json"))

    def _completion_events(self, job: _ClientRequest, first: RequestOutput) -> AsyncIterator[str]:
        offset = 0  # characters of token text streamed so far: the logprobs' text offsets
        first_chunk = True  # it carries the echoed prompt (and its logprobs)

        def chunk(out: RequestOutput, delta: str) -> CompletionChunk:
            nonlocal offset, first_chunk
            lp = None
            if job.want_logprobs:
                lp, offset = job.completion_logprobs(out.token_ids, out.logprobs, out.top_logprobs, offset,
                                                     with_prompt=first_chunk)
            text = job.echo_text() + delta if first_chunk else delta
            prompt_ids = job.prompt_ids if first_chunk else None
            first_chunk = False
            return CompletionChunk(id=job.id, model=self.model_name, usage=self._chunk_usage(job), choices=[
                CompletionChoice(text=text, logprobs=lp, finish_reason=job.finish_reason,
                                 token_ids=job.ids(out.token_ids), prompt_token_ids=prompt_ids)])

        return self._events(job, first, CompletionChunk, chunk)

    def _chat_events(self, job: _ClientRequest, first: RequestOutput) -> AsyncIterator[str]:
        def chunk(out: RequestOutput, delta: ChatDelta) -> ChatCompletionChunk:
            lp = job.chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs) if job.want_logprobs else None
            return ChatCompletionChunk(id=job.id, model=self.model_name, usage=self._chunk_usage(job), choices=[
                ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=job.finish_reason,
                                token_ids=job.ids(out.token_ids))])

        role = ChatCompletionChunk(id=job.id, model=self.model_name, usage=self._chunk_usage(job),
                                   prompt_token_ids=job.prompt_ids, choices=[
            ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
        return self._events(job, first, ChatCompletionChunk, chunk, opening=role)

    @staticmethod
    def _chunk_usage(job: _ClientRequest) -> Usage | None:
        """Usage so far, on every chunk when ``stream_options.continuous_usage_stats`` asks for it."""
        return job.usage() if job.body.continuous_usage else None

    async def _events(self, job: _ClientRequest, first: RequestOutput, chunk_type, chunk, opening=None) -> AsyncIterator[str]:
        """The SSE stream of one request: ``opening`` (if any), ``chunk(out, delta)``
        per output with new text (or logprobs, or the finish), an error event if
        the engine failed it, the usage chunk when asked for, ``[DONE]``."""
        try:
            if opening is not None:
                yield sse_event(opening)
            try:
                async for out in self._outputs(job, first):
                    if out.finish_reason == "error":
                        job.trace.end("error", output_error(out))
                        yield sse_event(output_error(out).to_response())
                        break
                    delta = job.take(out)
                    empty = delta.empty if isinstance(delta, ChatDelta) else not delta
                    if empty and not out.finished and not job.want_logprobs and not job.body.return_token_ids:
                        continue  # text held back (partial character, stop-string prefix, a tag's start)
                    yield sse_event(chunk(out, delta))
            except Exception as e:  # noqa: BLE001 - the decode call broke mid-stream (its replica died)
                err = stream_error(e)
                if err.status_code >= 500 and not isinstance(err, Unavailable):
                    log.error("the decode stream of %s failed", job.id, exc_info=e)
                job.trace.end("error", err)
                # A well-formed end: the error event, then [DONE], as for an error output.
                yield sse_event(err.to_response())
                yield SSE_DONE
                return
            if job.body.include_usage:
                yield sse_event(chunk_type(id=job.id, model=self.model_name, choices=[], usage=job.usage()))
            yield SSE_DONE
        finally:
            job.trace.end("cancelled")  # a no-op once it ended
            job.responses.cancel()  # a no-op once finished; frees the pages when the client left
            job.slot.release()
