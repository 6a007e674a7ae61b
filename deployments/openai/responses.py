"""OpenAI-compatible responses: bodies, stream chunks and server-sent events.

Chat messages carry ``reasoning_content`` (the model's thinking, separated
from ``content`` at ``</think>``) and ``tool_calls``; a stream's deltas carry
the same three, a tool call's ``id`` and name in its first delta and its
JSON arguments in pieces after (OpenAI's streaming shape). A delta leaves
out the fields it does not carry, as OpenAI's stream does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

__all__ = [
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprobs",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionResponse",
    "DeltaFunction",
    "DeltaToolCall",
    "FinishReason",
    "FunctionCall",
    "SSE_DONE",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "Usage",
    "new_id",
    "new_tool_call_id",
    "sse_event",
]

FinishReason = Literal["stop", "length", "tool_calls"]


def _now() -> int:
    return int(time.time())


def new_id(prefix: Literal["cmpl", "chatcmpl"]) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _TokenIds(BaseModel):
    """A body that may carry ``token_ids`` / ``prompt_token_ids`` (vLLM's ``return_token_ids``):
    left out of the JSON while None, so a request that did not ask sees OpenAI's shape."""

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        data = handler(self)
        for key in ("token_ids", "prompt_token_ids"):
            if key in data and data[key] is None:
                del data[key]
        return data


def new_tool_call_id() -> str:
    """A tool call's id (``call_`` + 24 hex digits, OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists per token (with ``echo``, the prompt's first:
    its first token's logprob and top are null). Built by `deployments.openai.logprobs`."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionChoice(_TokenIds):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None
    """``return_token_ids``: the output's ids (in a stream, this chunk's)."""
    prompt_token_ids: list[int] | None = None
    """``return_token_ids``: the prompt's ids (in a stream, on the first chunk only)."""


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text of the arguments, as OpenAI sends it."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_TokenIds):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_TokenIds):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    """``return_token_ids``: the rendered prompt's ids (vLLM puts them here, not in the choice)."""


class CompletionChunk(BaseModel):
    """One streamed piece of a completion (``object: text_completion``, as OpenAI streams it)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def _without_none(handler, obj) -> dict[str, Any]:
    return {k: v for k, v in handler(obj).items() if v is not None}


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _without_none(handler, self)


class DeltaToolCall(BaseModel):
    """A piece of tool call ``index``: the first has ``id``, ``type`` and the name; later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _without_none(handler, self)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _without_none(handler, self)

    @property
    def empty(self) -> bool:
        return not (self.role or self.content or self.reasoning_content or self.tool_calls)


class ChatChunkChoice(_TokenIds):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_TokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


# --------------------------------------------------------------------------- server-sent events

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream."""


def sse_event(payload: BaseModel | Mapping[str, Any]) -> str:
    """One SSE event ``data: <json>\\n\\n``.

    ``usage`` is left out of a chunk while it is None: OpenAI sends it only
    when ``stream_options`` asks for it. Error objects (``ErrorResponse``)
    stream the same way.
    """
    if isinstance(payload, BaseModel):
        data = payload.model_dump(mode="json")
    else:
        data = dict(payload)
    if data.get("usage", 0) is None:
        del data["usage"]
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
