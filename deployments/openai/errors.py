"""OpenAI error objects, the exceptions that carry them, and the request checks that raise them.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``; :func:`error_from_exception` maps any exception to an
:class:`OpenAIError` with the HTTP status to answer with (400 bad request,
404 unknown model, 429 overloaded, 503 a fault of the serving system (a
replica died, a KV transfer failed), 500 otherwise). ``param`` names the field
at fault (``messages[2].tool_call_id``), so a client can tell which of its
values was refused.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
from pydantic import BaseModel

__all__ = [
    "ContextLengthExceeded",
    "ErrorBody",
    "ErrorResponse",
    "InvalidRequest",
    "ModelNotFound",
    "OpenAIError",
    "Overloaded",
    "Unavailable",
    "check_model",
    "check_prompt_length",
    "error_from_exception",
    "from_validation_error",
]


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

    def headers(self) -> dict[str, str]:
        """HTTP headers of the error response besides the content type (``Retry-After`` of a 429)."""
        return {}

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
    """429: no capacity now (queues full, no free cache pages, waited too long to start); retry later.

    429 with ``Retry-After``, as api.openai.com answers a rate limit: OpenAI's
    clients retry it after that many seconds (a 503 they retry too, but
    without the hint). ``retry_after_s`` None: the ingress fills in its
    configured value (``limits.retry_after_s``).
    """

    status_code = 429
    type = "server_error"
    code = "overloaded"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message, param, code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(max(0, int(self.retry_after_s)))}


class Unavailable(OpenAIError):
    """503: the request was lost to a fault of the serving system, not refused for what it asked (a
    prefill or decode replica died, a KV transfer failed or expired); sending it again may succeed.

    OpenAI's clients retry a 503 (with their backoff). Serve replaces a dead replica by itself.
    """

    status_code = 503
    type = "server_error"
    code = "unavailable"


def _loc(loc: tuple[Any, ...]) -> str | None:
    parts = []
    for p in loc:
        parts.append(f"[{p}]" if isinstance(p, int) else ("." if parts else "") + str(p))
    return "".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: Any) -> bool:
    """Union members add their type to an error's location (``prompt.list[int]``); field names never look so."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS or part[:1].isupper())


def from_validation_error(err: pydantic.ValidationError) -> InvalidRequest:
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
    a full page pool (``workers.page_pool.PoolExhausted``) → 429; anything
    else → 500 without internal detail (the server logs it).
    """
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, json.JSONDecodeError):
        return InvalidRequest(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    if isinstance(exc, pydantic.ValidationError):
        return from_validation_error(exc)
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
