"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The body asks for a stream (``stream: true``) with the token counts at the end
(``stream_options: {include_usage: true}``). Every SSE line is timestamped with
``time.perf_counter()`` when it is read. A *content chunk* is a chunk with a
choice that carries text (``text`` for completions, ``delta.content`` or
``delta.reasoning_content`` for chat) or a ``finish_reason`` (a server may
hold a token's text back, e.g. a partial UTF-8 character, and send it with the
finish). Chat's opening role-only chunk is not content.

A request fails (``success`` False, ``error`` set) on: an HTTP status other
than 200 (``"HTTP 400: <the OpenAI error message>"``), an error event in the
stream, a connection error or timeout (``"ConnectError: ..."``), a stream that
ends before ``[DONE]`` or a ``finish_reason``, or a stream with no content
chunk. Times are seconds.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from bench.serve.datasets import SampleRequest
from bench.serve.metrics import RequestResult


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


def request_body(req: SampleRequest, *, model: str, chat: bool, temperature: float, ignore_eos: bool,
                 extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body for ``req`` (``max_tokens`` = its output length; for chat
    ``max_completion_tokens`` and the prompt as one user message)."""
    body: dict[str, Any] = {"model": model, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        if not isinstance(req.prompt, str):
            raise ValueError("a chat endpoint takes text prompts only: use /v1/completions for token-id prompts")
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return body


async def sse_lines(chunks):
    """Lines of an SSE body split at ``\n`` only. httpx's ``aiter_lines`` also splits at the
    Unicode line breaks (U+0085, U+2028, ...) that a server may send raw inside a JSON
    string (generated text), cutting one event in two."""
    buf = ""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line
    if buf:
        yield buf


def error_message(status: int, content: bytes) -> str:
    """``"HTTP <status>: <message>"`` from an OpenAI error body (``{"error": {"message": ...}}``,
    or vLLM's ``{"message": ...}``), else from the raw body (truncated)."""
    text = content.decode("utf-8", errors="replace").strip()
    msg = text
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and err.get("message"):
            msg = str(err["message"])
        elif isinstance(err, str):
            msg = err
    if len(msg) > 1000:
        msg = msg[:1000] + "..."
    return f"HTTP {status}: {msg}" if msg else f"HTTP {status}"


def _choice_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def exception_message(e: BaseException) -> str:
    detail = str(e) or repr(e)
    return f"{type(e).__name__}: {detail}"


async def send_request(http: httpx.AsyncClient, url: str, body: dict[str, Any], *, chat: bool,
                       prompt_len: int | None = None, headers: dict[str, str] | None = None) -> RequestResult:
    """POST ``body`` to ``url`` and time its stream. Never raises for a failed
    request: the failure is in the result (cancellation still propagates)."""
    r = RequestResult(prompt_tokens=prompt_len)
    chunks = 0
    finished = done = False
    text_parts: list[str] = []
    usage: dict | None = None
    content = json.dumps(body).encode()  # before the clock starts: long token-id prompts take a while
    headers = {**(headers or {}), "content-type": "application/json"}
    r.start = last = time.perf_counter()
    try:
        async with http.stream("POST", url, content=content, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = error_message(resp.status_code, await resp.aread())
                r.e2el = time.perf_counter() - r.start
                return r
            async for line in sse_lines(resp.aiter_text()):
                now = time.perf_counter()
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), "event:" lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if not isinstance(data, dict):
                    continue
                if data.get("error") is not None:
                    err = data["error"]
                    msg = err.get("message") if isinstance(err, dict) else err
                    r.error = f"error event in the stream: {msg}"
                    r.e2el = now - r.start
                    return r
                if data.get("usage"):
                    usage = data["usage"]
                choices = data.get("choices") or []
                if not choices:
                    continue
                choice = choices[0]
                text = _choice_text(choice, chat)
                if choice.get("finish_reason") is not None:
                    finished = True
                elif not text:
                    continue
                text_parts.append(text)
                if chunks == 0:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last)
                r.chunk_times.append(now - r.start)
                last = now
                chunks += 1
            r.e2el = time.perf_counter() - r.start
    except httpx.HTTPError as e:
        r.error = exception_message(e)
        r.e2el = time.perf_counter() - r.start
        return r
    except ValueError as e:  # a data line that is not JSON
        r.error = f"bad stream: {exception_message(e)}"
        r.e2el = time.perf_counter() - r.start
        return r
    r.generated_text = "".join(text_parts)
    if usage is not None and usage.get("completion_tokens") is not None:
        r.output_tokens = int(usage["completion_tokens"])
        r.output_tokens_from_usage = True
    else:
        r.output_tokens = chunks
    if usage is not None and usage.get("prompt_tokens") is not None:
        r.prompt_tokens = int(usage["prompt_tokens"])
    if chunks == 0:
        r.error = "the stream had no content chunk (no TTFT)"
    elif not (done or finished):
        r.error = "the stream ended before [DONE] or a finish_reason"
    else:
        r.success = True
    return r
