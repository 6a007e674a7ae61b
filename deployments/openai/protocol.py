"""OpenAI-compatible requests: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Pure data and validation; the ingress deployment does the I/O. What we do
not support is an error naming the field, never silently ignored: ``n`` or
``best_of`` other than 1, a batch of more than one prompt (a batch of one is
that prompt: lm-evaluation-harness sends one), or any
field OpenAI (or the load generators, see below) does not define (OpenAI
itself answers "Unrecognized request argument supplied").

Extensions, as in vLLM: ``top_k`` (0 or -1 = off), ``min_p`` (0 = off),
``repetition_penalty`` (1 = off), ``min_tokens`` (0 = off), ``ignore_eos``
(keep generating past EOS, for load tests), ``stop_token_ids``,
``chat_template_kwargs`` (``thinking`` / ``enable_thinking`` /
``thinking_mode``, ``drop_thinking``; anything else reaches a Jinja chat
template as a variable), ``include_reasoning`` and
``stream_options.continuous_usage_stats`` (``usage`` on every chunk).

The load generators' bodies parse as they are: ``vllm bench serve`` sends
``repetition_penalty: 1.0``, ``logprobs: null`` and ``stream_options``;
SGLang's ``bench_serving`` sends ``best_of: 1``, ``temperature: 0`` and
``ignore_eos`` (``tests/deployments/bench_payloads.py`` holds both, from their sources).

Rules that relate several fields, or a message to its place in the
conversation, are checked by ``check()`` after parsing, so that every
refusal names the field at fault (``messages[3].tool_call_id``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.openai.errors import InvalidRequest, from_validation_error
from deployments.openai.limits import decode_json
from deployments.openai.structured import StructuredOutputs, check_structured

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "FunctionDefinition",
    "MessageToolCall",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "TextPart",
    "ToolDefinition",
    "parse_request",
]

LOGIT_BIAS_LIMIT = 100.0
"""OpenAI's range for a ``logit_bias`` value: [-100, 100]."""


class _Body(BaseModel):
    # extra="forbid": an argument we do not know is reported, as OpenAI does,
    # instead of being silently ignored.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="Extension (vLLM): usage on every chunk.")


class _Request(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Extension: sample from the k most likely tokens; 0 or -1 = off.")
    seed: int | None = None
    ignore_eos: bool = Field(False, description="Extension: do not stop at the model's EOS token.")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="Extension: token ids that end the output.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Extension: drop tokens below min_p x the top probability.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="Extension (HF / vLLM): penalise prompt and "
                                      "generated tokens; 1 = off.")
    min_tokens: int = Field(0, ge=0, description="Extension: no EOS or stop token before this many tokens.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit before sampling.")
    return_token_ids: bool = Field(False, description="Extension (vLLM): the prompt's and the output's token ids "
                                   "beside the text (a stream: each chunk's ids, the prompt's on the first).")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (vLLM): one of json / regex / choice / grammar / json_object "
        "(deployments/openai/structured.py).")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):  # int() takes other digits too
                raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def check(self) -> None:
        """Rules across fields, raised as ``InvalidRequest`` naming the field (after parsing)."""
        limit = self.completion_limit
        if limit is not None and self.min_tokens > limit:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})",
                                 param="min_tokens")
        check_structured(self)  # response_format, tool_choice, structured_outputs: at most one, well formed

    @property
    def completion_limit(self) -> int | None:
        """Most tokens to generate as asked; None = up to the context limit."""
        return self.max_tokens

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

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs``: None = none (only completions with ``echo`` ask)."""
        return None

    @property
    def include_usage(self) -> bool:
        """A last chunk with the request's usage (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every chunk (``stream_options.continuous_usage_stats``)."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as sorted (token id, bias) pairs, zero biases left out (they change nothing)."""
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items() if v != 0))

    def sampling_params(self, max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()):
        """``workers.sample.params.SamplingParams`` for this request.

        ``max_new_tokens`` comes from ``check_prompt_length`` (it needs the
        prompt's token count); ``stop`` strings travel as ``stop_strings``
        (the engine matches them on detokenized text).
        """
        from workers.sample.params import SamplingParams

        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.effective_top_k,
            seed=self.seed,
            stop_token_ids=tuple(stop_token_ids) + tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            stop_strings=self.stop_sequences,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.engine_logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            min_tokens=min(self.min_tokens, max_new_tokens),
            logit_bias=self.logit_bias_pairs(),
        )


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is one string or one list of token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20, description="Top log-probabilities per token (0..20: "
                                 "OpenAI's limit is 5, vLLM's 20).")
    echo: bool = Field(False, description="Return the prompt before the completion; with logprobs, the prompt's "
                       "token logprobs too (the first null).")
    best_of: int | None = Field(None, description="Candidates to choose from server-side; only 1.")
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's completions default

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            # A batch of one: what lm-evaluation-harness' local-completions sends at batch size 1.
            v = v[0]
        if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
            raise ValueError("prompt must be one string or one list of token ids; send one request per prompt")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list of token ids")
        if v == "":
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
            raise ValueError("prompt token ids must be non-negative integers")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"best_of must be 1 (one candidate per request), got {v}")
        return v

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt's logprobs are computed only for ``echo`` with ``logprobs``."""
        return self.logprobs if self.echo else None


# --------------------------------------------------------------------------- chat messages and tools


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = Field(description="JSON text of the arguments (an object is accepted too).")

    @property
    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)


class MessageToolCall(_Body):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_Body):
    """One message of a conversation.

    ``content`` is a string or a list of text parts (no images); an
    assistant message with ``tool_calls`` may have none. ``reasoning_content``
    (or vLLM's ``reasoning``) is an assistant's earlier thinking; ``tool``
    messages answer a call by ``tool_call_id``.
    """

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    @property
    def thinking(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def check(self, where: str) -> None:
        """Role rules, naming ``where`` (``messages[i]``) in the error."""
        if self.role != "assistant":
            for field in ("tool_calls", "reasoning_content", "reasoning"):
                if getattr(self, field) is not None:
                    raise InvalidRequest(f"{where}.{field} is only allowed on assistant messages",
                                         param=f"{where}.{field}")
        if self.role == "tool":
            if not self.tool_call_id:
                raise InvalidRequest(f"{where}.tool_call_id is required on tool messages",
                                     param=f"{where}.tool_call_id")
        elif self.tool_call_id is not None:
            raise InvalidRequest(f"{where}.tool_call_id is only allowed on tool messages",
                                 param=f"{where}.tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise InvalidRequest(f"{where}.content is required (only an assistant message with tool_calls may "
                                 "omit it)", param=f"{where}.content")
        for j, call in enumerate(self.tool_calls or ()):
            arg_path = f"{where}.tool_calls[{j}].function.arguments"
            try:  # decode_json: a client's JSON text, as bounded as the body it came in
                args = decode_json(call.function.arguments_json, what=arg_path)
            except InvalidRequest as e:
                raise InvalidRequest(e.message, param=arg_path) from e
            if not isinstance(args, dict):
                raise InvalidRequest(f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                                     param=f"{where}.tool_calls[{j}].function.arguments")

    def to_dict(self) -> dict[str, Any]:
        """The message as chat encoders take it: text content, OpenAI-shaped tool calls with
        ``arguments`` as JSON text, ``reasoning_content``; absent fields left out."""
        out: dict[str, Any] = {"role": self.role, "content": self.text if self.content is not None else None}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments_json}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.thinking is not None:
            out["reasoning_content"] = self.thinking
        return out


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class _ToolName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: _ToolName


class ResponseFormat(_Body):
    """``response_format``: ``text`` (the default), ``json_object`` or ``json_schema`` (``{"name",
    "schema", "strict"}``, checked by `deployments.openai.structured.check_structured`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="'none' turns thinking off, any other level on (the served models have no levels).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension: thinking / enable_thinking / thinking_mode, drop_thinking; other keys "
        "are variables of the checkpoint's Jinja chat template.")
    include_reasoning: bool = Field(True, description="Extension (vLLM): false drops reasoning_content.")

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        return self

    def check(self) -> None:
        super().check()
        for i, m in enumerate(self.messages):
            m.check(f"messages[{i}]")
        self._check_tool_history()
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools must have distinct function names", param="tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequest(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                     param="tool_choice")
        if choice == "required":
            if not names:
                raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")

    def _check_tool_history(self) -> None:
        """Each tool message answers a call of the assistant turn before it, in order, once."""
        pending: list[str] = []
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                pending = [c.id for c in m.tool_calls or ()]
            elif m.role == "tool":
                if not pending:
                    raise InvalidRequest(f"messages[{i}] is a tool result, but no assistant tool call before it "
                                         "is left unanswered", param=f"messages[{i}]")
                if m.tool_call_id not in pending:
                    raise InvalidRequest(f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no call of the "
                                         f"assistant turn before it (open: {pending})",
                                         param=f"messages[{i}].tool_call_id")
                pending.remove(m.tool_call_id)
            else:
                pending = []

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``; None = up to the context limit."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def parses_tools(self) -> bool:
        """Tool calls in the output become ``tool_calls`` (tools given, ``tool_choice`` not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as chat encoders take them (``ChatMessage.to_dict``)."""
        return [m.to_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """``tools`` in OpenAI's shape, as chat templates take them; None without tools."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def parse_request(body: bytes | str | Mapping[str, Any], kind: Literal["completion", "chat"]):
    """Parse and check a request body into ``CompletionRequest`` / ``ChatCompletionRequest``,
    or raise ``InvalidRequest``."""
    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
    # decode_json: strict UTF-8 JSON of bounded depth, a 400 for anything else (deployments/openai/limits.py).
    data = decode_json(body) if isinstance(body, (bytes, str)) else body
    if not isinstance(data, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        req = cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from e
    req.check()
    return req
