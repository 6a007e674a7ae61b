"""OpenAI-compatible wire format: requests, responses, stream chunks and errors.

Covers ``POST /v1/completions`` and ``POST /v1/chat/completions``. Pure data
and conversions; the ingress deployment does the I/O. What we do not
support is an error, never silently ignored: ``n`` other than 1, a batch of
prompts, tools, or any field OpenAI does not define (OpenAI itself answers
"Unrecognized request argument supplied"). ``top_k`` (0 or -1 = off),
``min_p`` (0 = off), ``repetition_penalty`` (1 = off) and ``ignore_eos``
(keep generating past EOS, for load tests and benchmarks) are extensions, as
in vLLM.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``; :func:`error_from_exception` maps our exceptions to an
:class:`OpenAIError` with the HTTP status (400 bad request, 404 unknown
model, 503 overloaded, 500 otherwise).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatDelta",
    "ChatLogprobs",
    "CompletionChoice",
    "CompletionLogprobs",
    "StreamOptions",
    "TextPart",
    "TokenLogprob",
    "TopLogprob",
    "new_id",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "ContextLengthExceeded",
    "ErrorBody",
    "ErrorResponse",
    "InvalidRequest",
    "ModelNotFound",
    "OpenAIError",
    "Overloaded",
    "SSE_DONE",
    "Usage",
    "check_model",
    "check_prompt_length",
    "error_from_exception",
    "parse_request",
    "sse_event",
]

FinishReason = Literal["stop", "length"]


# --------------------------------------------------------------------------- errors


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response: ``{"error": {...}}``."""

    error: ErrorBody


class OpenAIError(Exception):
    """An error to answer with ``status_code`` and an OpenAI error object."""

    status_code = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def to_json(self) -> str:
        return self.to_response().model_dump_json()


class InvalidRequest(OpenAIError):
    """400: a malformed body, a bad value, or something we do not support."""

    status_code = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """400: prompt (+ requested completion) longer than the served context."""

    code = "context_length_exceeded"


class ModelNotFound(OpenAIError):
    """404: ``model`` is not the served model."""

    status_code = 404
    type = "invalid_request_error"
    code = "model_not_found"


class Overloaded(OpenAIError):
    """503: no capacity now (queues full, no free cache pages); the client should retry later."""

    status_code = 503
    type = "server_error"
    code = "overloaded"


def _loc(loc: tuple[Any, ...]) -> str | None:
    parts = []
    for p in loc:
        parts.append(f"[{p}]" if isinstance(p, int) else ("." if parts else "") + str(p))
    return "".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: Any) -> bool:
    """Union members add their type to an error's location (``prompt.list[int]``); field names never look so."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS or part[:1].isupper())


def _from_validation_error(err: pydantic.ValidationError) -> InvalidRequest:
    """The first error of a request validation as OpenAI would word it; the rest appended."""
    msgs, param = [], None
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not _is_type_tag(p))
        where = _loc(loc)
        if e["type"] == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {where}"
        elif e["type"] == "value_error":
            msg = str(e.get("ctx", {}).get("error", e["msg"]))
        elif e["type"] == "missing":
            msg = f"{where}: required"
        else:
            msg = f"{where}: {e['msg']} (got {e.get('input')!r})"
        if param is None:
            param = where
        if msg not in msgs:
            msgs.append(msg)
    return InvalidRequest("; ".join(msgs), param=param)


def error_from_exception(exc: BaseException) -> OpenAIError:
    """Map any exception to the ``OpenAIError`` to answer with.

    ``OpenAIError`` as is; invalid JSON and pydantic validation errors → 400;
    a full page pool (``workers.page_pool.PoolExhausted``) → 503; anything
    else → 500 without internal detail (the server logs it).
    """
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, json.JSONDecodeError):
        return InvalidRequest(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    if isinstance(exc, pydantic.ValidationError):
        return _from_validation_error(exc)
    from workers.page_pool import PoolExhausted

    if isinstance(exc, PoolExhausted):
        return Overloaded(f"the server is out of KV cache pages ({exc}); retry later")
    return OpenAIError("internal server error")


def check_model(requested: str, served: str | tuple[str, ...] | list[str]) -> None:
    """Raise ``ModelNotFound`` unless ``requested`` is (one of) the served model name(s)."""
    names = (served,) if isinstance(served, str) else tuple(served)
    if requested not in names:
        raise ModelNotFound(
            f"The model `{requested}` does not exist. Served: {', '.join(f'`{n}`' for n in names)}.", param="model"
        )


def check_prompt_length(prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """The number of tokens to generate, or ``ContextLengthExceeded``.

    ``max_tokens`` None means "up to the context limit". ``param`` is
    ``"prompt"`` or ``"messages"`` (named in the error).
    """
    if prompt_tokens >= max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your {param} has "
            f"{prompt_tokens} tokens, leaving no room for a completion. Please reduce the length of the {param}.",
            param=param,
        )
    room = max_model_len - prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, {max_tokens} in the completion). "
            f"Please reduce the length of the {param} or completion.",
            param="max_tokens",
        )
    return max_tokens


# --------------------------------------------------------------------------- requests


class _Request(BaseModel):
    # extra="forbid": an argument we do not know is reported, as OpenAI does,
    # instead of being silently ignored.
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Extension: sample from the k most likely tokens; 0 or -1 = off.")
    seed: int | None = None
    ignore_eos: bool = Field(False, description="Extension: do not stop at the model's EOS token.")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Extension: drop tokens below min_p x the top probability.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="Extension (HF / vLLM): penalise prompt and "
                                      "generated tokens; 1 = off.")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        if v == "":
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def effective_top_k(self) -> int:
        """``top_k`` for ``workers.sample.params.SamplingParams`` (0 = off)."""
        return max(self.top_k, 0)

    @property
    def engine_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: top log-probabilities per token, None = the chosen token's only."""
        return None

    def sampling_params(self, max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()):
        """``workers.sample.params.SamplingParams`` for this request.

        ``max_new_tokens`` comes from :func:`check_prompt_length` (it needs
        the prompt's token count); ``stop`` strings travel as
        ``stop_strings`` (the engine matches them on detokenized text).
        """
        from workers.sample.params import SamplingParams

        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.effective_top_k,
            seed=self.seed,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=self.ignore_eos,
            stop_strings=self.stop_sequences,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.engine_logprobs,
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is one string or one list of token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5, description="Top log-probabilities per token (0..5).")
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's completions default

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
            raise ValueError("prompt must be one string or one list of token ids; send one request per prompt")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list of token ids")
        if isinstance(v, list) and any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
            raise ValueError("prompt token ids must be non-negative integers")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of text parts (no images, no tool calls)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        return self

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``; None = up to the context limit."""
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as ``tokenizer.apply_chat_template`` takes them."""
        return [{"role": m.role, "content": m.text} for m in self.messages]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


def parse_request(body: bytes | str | Mapping[str, Any], kind: Literal["completion", "chat"]):
    """Parse a request body into ``CompletionRequest`` / ``ChatCompletionRequest`` or raise ``InvalidRequest``."""
    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
    try:
        data = json.loads(body) if isinstance(body, (bytes, str)) else dict(body)
    except json.JSONDecodeError as e:
        raise error_from_exception(e) from e
    if not isinstance(data, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise _from_validation_error(e) from e


# --------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


def new_id(prefix: Literal["cmpl", "chatcmpl"]) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One streamed piece of a completion (``object: text_completion``, as OpenAI streams it)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------- server-sent events

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream."""


def sse_event(payload: BaseModel | Mapping[str, Any]) -> str:
    """One SSE event ``data: <json>\\n\\n``.

    ``usage`` is left out of a chunk while it is None: OpenAI sends it only
    when ``stream_options.include_usage`` asks for it, on the last chunk.
    Error objects (``ErrorResponse``) stream the same way.
    """
    if isinstance(payload, BaseModel):
        data = payload.model_dump(mode="json")
    else:
        data = dict(payload)
    if data.get("usage", 0) is None:
        del data["usage"]
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
