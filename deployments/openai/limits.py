"""Request bodies from untrusted clients: bounded size, strict UTF-8 JSON, bounded nesting.

Free of Ray, like the rest of ``deployments.openai``. The ingress reads a body
with :func:`read_body` (at most ``max_body_bytes``, else 413) and parses it
with :func:`decode_json`, so that every malformed body is an OpenAI 400 and
never a 500 or a stuck replica:

- not UTF-8: ``json.loads(bytes)`` would guess UTF-16/32 from the first bytes
  and raise ``UnicodeDecodeError``; RFC 8259 JSON between systems is UTF-8;
- nested past ``max_json_depth``: the C scanner recurses once per level and
  raises ``RecursionError`` around a thousand levels; our own models nest at
  most a few levels (tool schemas a dozen), so the limit is set far below;
- ``NaN`` / ``Infinity`` / ``-Infinity`` and numbers that overflow a float
  (``1e400``): not JSON values, and they would reach the sampler as
  non-finite floats;
- integers longer than Python's 4300-digit conversion limit (a ``ValueError``
  that is not a ``JSONDecodeError``);
- strings holding a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON
  syntax but no Unicode text): the tokenizer raises ``TypeError`` on them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from deployments.openai.errors import InvalidRequest, OpenAIError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_JSON_DEPTH",
    "BodyTooLarge",
    "decode_json",
    "read_body",
]

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""8 MiB: a 128k-token prompt as token ids is ~0.9 MB of JSON, as text ~0.5 MB; a long chat with tools a few MB."""
DEFAULT_MAX_JSON_DEPTH = 64
"""Containers inside containers: a chat body is 4 deep, tool parameter schemas add a dozen or so."""


class BodyTooLarge(OpenAIError):
    """413: the body is longer than the server's limit (read no further than the limit)."""

    status_code = 413
    type = "invalid_request_error"
    code = "request_too_large"


class _BadConstant(ValueError):
    """A JSON value that parses in Python but is no JSON value (NaN, Infinity, 1e400)."""


def _constant(name: str) -> Any:
    raise _BadConstant(f"{name} is not a JSON value")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadConstant(f"the number {text[:40]} does not fit a 64-bit float")
    return value


_SCALARS = frozenset((int, float, bool, type(None)))
"""What `json.loads` makes that holds no text and nests nothing."""


def _walk(value: Any, max_depth: int, what: str) -> None:
    """Raise ``InvalidRequest`` if ``value`` nests past ``max_depth`` or holds a lone surrogate.

    Iterative (a stack, not recursion): it runs on bodies the size limit
    allows, whatever their shape.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, what)
        elif isinstance(v, (list, dict)):
            if depth >= max_depth:
                raise InvalidRequest(f"{what} nests JSON arrays/objects deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    _check_text(k, what)
                    stack.append((item, depth + 1))
            elif not _SCALARS.issuperset(map(type, v)):  # a prompt of token ids: no item to look into
                stack.extend((item, depth + 1) for item in v if isinstance(item, (str, list, dict)))


def _check_text(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} holds a string that is not valid Unicode ({e.reason} at "
                             f"character {e.start}: a lone UTF-16 surrogate escape such as \\ud800)") from None


def decode_json(body: bytes | str, max_depth: int = DEFAULT_MAX_JSON_DEPTH, what: str = "request body") -> Any:
    """Parse a request body (see the module doc); ``InvalidRequest`` (400) for anything that is not
    strict JSON in UTF-8 nesting at most ``max_depth`` containers deep. ``what`` names the text in
    the error (a body, or a field holding JSON text such as tool-call arguments)."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"{what} is not valid UTF-8 (byte {e.start}: {e.reason}); "
                                 "send JSON encoded as UTF-8") from None
    else:
        text = body
    try:
        data = json.loads(text, parse_constant=_constant, parse_float=_float)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise InvalidRequest(f"{what} nests JSON arrays/objects deeper than {max_depth} levels") from None
    except _BadConstant as e:
        raise InvalidRequest(f"{what} is not valid JSON: {e}") from None
    except ValueError:  # int() past Python's 4300-digit limit: no field of ours takes such a number
        raise InvalidRequest(f"{what} holds an integer with more than 4300 digits") from None
    _walk(data, max_depth, what)
    return data


async def read_body(request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The body of a Starlette ``request``, or ``BodyTooLarge`` as soon as it passes ``max_bytes``.

    A ``Content-Length`` over the limit is refused before reading; a chunked
    body is read piece by piece and dropped at the limit, so a client cannot
    make the ingress buffer more than ``max_bytes``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"request body is {int(declared)} bytes; this server accepts at most {max_bytes}")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"request body is longer than {max_bytes} bytes, the most this server accepts")
        parts.append(chunk)
    return b"".join(parts)
