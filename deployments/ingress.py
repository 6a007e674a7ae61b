"""The OpenAI-compatible HTTP ingress (FastAPI inside Serve).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
server-sent events or not), ``GET /v1/models``, ``GET /health`` (200 once
every role has a live replica and a decode replica has handshaked with a
prefill one — in monolithic mode, once a decode replica is up; 503 before)
and ``GET /stats`` (every replica's load figures
from the peer directory: free pages, queues, MTP counts).

The ingress tokenizes (the checkpoint's tokenizer; chat through its chat
template), checks the model name, the context limit and the sampling values
(answering OpenAI error objects with their status codes: 400, 404, 503),
routes the request to a decode replica (`deployments.router.DecodeRouter`,
with a prefix-affinity hint) and turns the decode replica's token outputs
into text. It waits for the first output before answering, so a request
refused at admission still gets an error status rather than a broken stream.
A client that disconnects cancels the request: Serve cancels this handler,
and the handler cancels its decode call, which frees pages on both sides.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route
# handlers' annotations (``request: Request``) as real types.
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from deployments.app_config import AppConfig
from deployments.openai_protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    InvalidRequest,
    OpenAIError,
    Overloaded,
    TokenLogprob,
    Usage,
    check_model,
    check_prompt_length,
    error_from_exception,
    new_id,
    parse_request,
    sse_event,
)
from deployments.replica_stats import DecodeStats
from deployments.router import prefix_hash
from deployments.text_stream import TextStream
from models.config import load_config
from workers.engine import RequestOutput

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console

app = FastAPI(title="dsa-pd", description="OpenAI-compatible API of a disaggregated prefill/decode DSA model")

# Engine finish reasons -> OpenAI's; an aborted request never reaches a client.
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def error_response(exc: BaseException) -> JSONResponse:
    err = error_from_exception(exc)
    if err.status_code >= 500 and not isinstance(exc, OpenAIError):
        log.error("internal error answering a request", exc_info=exc)
    return JSONResponse(err.to_response().model_dump(mode="json"), status_code=err.status_code)


def output_error(out: RequestOutput) -> OpenAIError:
    """The error to answer for an engine output that ended the request with an error."""
    msg = out.error or "the request failed"
    if msg.startswith("overloaded:"):
        return Overloaded(msg.removeprefix("overloaded:").strip())
    return OpenAIError(msg)


class _ClientRequest:
    """One admitted request on its way out: the decode stream, its text and its counts."""

    def __init__(self, kind: str, body, prompt_len: int, tokenizer):
        self.kind, self.body, self.prompt_len = kind, body, prompt_len
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.text = TextStream(tokenizer, body.stop_sequences)
        self.tokenizer = tokenizer
        self.responses = None  # the DeploymentResponseGenerator of the decode call, once made
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []

    @property
    def want_logprobs(self) -> bool:
        return self.body.logprobs is not None if self.kind == "completion" else bool(self.body.logprobs)

    def take(self, out: RequestOutput) -> str:
        """Account an output; returns the new safe text."""
        self.completion_tokens += len(out.token_ids)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        text = self.text.push(out.token_ids)
        if out.finished:
            self.finish_reason = _FINISH.get(out.finish_reason or "", "stop")
            text += self.text.finish()
        return text

    def completion_logprobs(self, ids: list[int], lps: list[float], offset: int) -> CompletionLogprobs:
        toks = [self.tokenizer.decode([t]) for t in ids]
        offsets = []
        for t in toks:
            offsets.append(offset)
            offset += len(t)
        return CompletionLogprobs(tokens=toks, token_logprobs=lps, top_logprobs=None, text_offset=offsets)

    def chat_logprobs(self, ids: list[int], lps: list[float]) -> ChatLogprobs:
        content = []
        for t, lp in zip(ids, lps):
            tok = self.tokenizer.decode([t])
            content.append(TokenLogprob(token=tok, logprob=lp, bytes=list(tok.encode()), top_logprobs=[]))
        return ChatLogprobs(content=content)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_len, self.completion_tokens)


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, app_args: dict[str, Any], model_dir: str, decode, directory):
        from transformers import AutoTokenizer

        cfg = AppConfig.model_validate(app_args)
        model_cfg = load_config(model_dir)
        self.model_name = cfg.model_name
        self.max_model_len = cfg.model.max_model_len or model_cfg.max_position_embeddings
        self.vocab_size = model_cfg.vocab_size
        self.prefix_pages = cfg.router.prefix_affinity_pages
        self.mode = cfg.mode
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.decode = decode.options(stream=True)
        self.directory = directory
        self.created = int(time.time())

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
        return await self.directory.snapshot.remote()

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "dsa-pd", "max_model_len": self.max_model_len}]}

    # -------------------------------------------------------------- requests
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        try:
            body: CompletionRequest = parse_request(await request.body(), "completion")
            check_model(body.model, self.model_name)
            if isinstance(body.prompt, str):
                ids = self.tokenizer(body.prompt)["input_ids"]
            else:
                ids = list(body.prompt)
                bad = [t for t in ids if t >= self.vocab_size]
                if bad:
                    raise InvalidRequest(f"token id {bad[0]} is out of the vocabulary (size {self.vocab_size})",
                                         param="prompt")
            if body.logprobs:
                raise InvalidRequest("logprobs > 0 (alternatives per token) is not supported; use 0",
                                     param="logprobs")
            params = self._params(body, ids, body.max_tokens, "prompt")
        except Exception as e:  # noqa: BLE001 - every refusal is an OpenAI error object
            return error_response(e)
        return await self._run("completion", body, ids, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            body: ChatCompletionRequest = parse_request(await request.body(), "chat")
            check_model(body.model, self.model_name)
            if body.top_logprobs:
                raise InvalidRequest("top_logprobs > 0 is not supported; use 0", param="top_logprobs")
            # The chat templates of these models know system/user/assistant;
            # OpenAI's "developer" role is the newer name for "system".
            messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                        for m in body.chat_messages()]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - the template refused the conversation
                raise InvalidRequest(f"the chat template refused the messages: {e}", param="messages") from e
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            params = self._params(body, ids, body.completion_limit, "messages")
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return await self._run("chat", body, ids, params)

    def _params(self, body, ids: list[int], limit: int | None, param: str):
        if not ids:
            raise InvalidRequest(f"the {param} is empty after tokenization", param=param)
        max_new = check_prompt_length(len(ids), limit, self.max_model_len, param)
        try:
            return body.sampling_params(max_new)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e

    async def _run(self, kind: str, body, ids: list[int], params) -> Response:
        job = _ClientRequest(kind, body, len(ids), self.tokenizer)
        job.responses = self.decode.generate.remote(job.id, ids, params,
                                                    prefix_hash=prefix_hash(ids, self.prefix_pages))
        handed_over = False
        try:
            try:
                first = await job.responses.__anext__()
            except StopAsyncIteration:
                return error_response(OpenAIError("the decode replica ended the request without output"))
            if first.finish_reason == "error":
                return error_response(output_error(first))
            if body.stream:
                handed_over = True  # the stream owns the call from here
                events = self._completion_events(job, first) if kind == "completion" else self._chat_events(job, first)
                return StreamingResponse(events, media_type="text/event-stream")
            return await self._collect(job, first)
        except Exception as e:  # noqa: BLE001 - e.g. the decode replica died
            return error_response(e)
        finally:
            if not handed_over:
                # Finished: a no-op. Cancelled (client gone): Serve cancels the decode call.
                job.responses.cancel()

    async def _outputs(self, job: _ClientRequest, first: RequestOutput) -> AsyncIterator[RequestOutput]:
        out = first
        while True:
            yield out
            if out.finished:
                return
            out = await job.responses.__anext__()

    async def _collect(self, job: _ClientRequest, first: RequestOutput) -> Response:
        async for out in self._outputs(job, first):
            if out.finish_reason == "error":
                return error_response(output_error(out))
            job.take(out)
        text = job.text.text
        if job.kind == "completion":
            lp = job.completion_logprobs(job.token_ids, job.logprobs, 0) if job.want_logprobs else None
            resp = CompletionResponse(id=job.id, model=self.model_name, usage=job.usage(), choices=[
                CompletionChoice(text=text, logprobs=lp, finish_reason=job.finish_reason)])
        else:
            lp = job.chat_logprobs(job.token_ids, job.logprobs) if job.want_logprobs else None
            resp = ChatCompletionResponse(id=job.id, model=self.model_name, usage=job.usage(), choices=[
                ChatChoice(message=AssistantMessage(content=text), logprobs=lp, finish_reason=job.finish_reason)])
        return JSONResponse(resp.model_dump(mode="json"))

    def _include_usage(self, job: _ClientRequest) -> bool:
        return job.body.stream_options is not None and job.body.stream_options.include_usage

    def _completion_events(self, job: _ClientRequest, first: RequestOutput) -> AsyncIterator[str]:
        offset = 0  # characters of text streamed so far: the logprobs' text offsets

        def chunk(out: RequestOutput, delta: str) -> CompletionChunk:
            nonlocal offset
            lp = None
            if job.want_logprobs:
                lp = job.completion_logprobs(out.token_ids, out.logprobs, offset)
                offset += sum(len(t) for t in lp.tokens)
            return CompletionChunk(id=job.id, model=self.model_name, choices=[
                CompletionChoice(text=delta, logprobs=lp, finish_reason=job.finish_reason)])

        return self._events(job, first, CompletionChunk, chunk)

    def _chat_events(self, job: _ClientRequest, first: RequestOutput) -> AsyncIterator[str]:
        def chunk(out: RequestOutput, delta: str) -> ChatCompletionChunk:
            lp = job.chat_logprobs(out.token_ids, out.logprobs) if job.want_logprobs else None
            return ChatCompletionChunk(id=job.id, model=self.model_name, choices=[
                ChatChunkChoice(delta=ChatDelta(content=delta), logprobs=lp, finish_reason=job.finish_reason)])

        role = ChatCompletionChunk(id=job.id, model=self.model_name, choices=[
            ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
        return self._events(job, first, ChatCompletionChunk, chunk, opening=role)

    async def _events(self, job: _ClientRequest, first: RequestOutput, chunk_type, chunk, opening=None) -> AsyncIterator[str]:
        """The SSE stream of one request: ``opening`` (if any), ``chunk(out, delta)``
        per output with new text (or logprobs, or the finish), an error event if
        the engine failed it, the usage chunk when asked for, ``[DONE]``."""
        try:
            if opening is not None:
                yield sse_event(opening)
            async for out in self._outputs(job, first):
                if out.finish_reason == "error":
                    yield sse_event(output_error(out).to_response())
                    break
                delta = job.take(out)
                if not delta and not out.finished and not job.want_logprobs:
                    continue  # text held back (partial character or stop-string prefix)
                yield sse_event(chunk(out, delta))
            if self._include_usage(job):
                yield sse_event(chunk_type(id=job.id, model=self.model_name, choices=[], usage=job.usage()))
            yield SSE_DONE
        finally:
            job.responses.cancel()  # a no-op once finished; frees the pages when the client left
