"""NIXL notification messages between a pushing (prefill) and a receiving (decode) agent.

Every message is ``PREFIX + compact JSON``; anything else in a notification
queue (another library sharing the agent, a future version) decodes to None
and is ignored.

- `ChunkDone` (prefill -> decode): attached to the WRITE of one chunk, so it is
  delivered only after that chunk's bytes landed. The last chunk of a request
  carries the chunk count and the total page count; decode completes when it
  has every index below the count (notifications of separate WRITEs may
  arrive in any order).
- `PushAborted` (prefill -> decode): the push failed or expired. Sent only once
  no WRITE of the request is in flight any more, so decode may free its pages
  on receipt.
- `PushCancelled` (decode -> prefill): decode gave up (deadline, client gone,
  inconsistent notifications); stop pushing. Decode keeps the request's pages
  out of its pool until the answer below (or until the peer is known dead):
  a WRITE prefill already posted may still land in them.
- `PushSettled` (prefill -> decode): the answer to a `PushCancelled`: no WRITE
  of that request from this agent is in flight or will be posted (sent after
  its posted WRITEs completed or failed; at once if there were none, or if
  this agent never had the request, which it then refuses to begin).
- `WarmUp` (prefill -> decode): attached to the warm-up WRITE at start, so the
  pair's notification path is exercised before the first request; the
  receiving agent drops it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

PREFIX = b"dsapd1:"


@dataclass(frozen=True)
class ChunkDone:
    request_id: str
    index: int
    count: Optional[int] = None
    """Number of chunks of the request; set on the last chunk only."""
    pages: Optional[int] = None
    """Pages pushed in total; set on the last chunk only (decode cross-checks its reservation)."""


@dataclass(frozen=True)
class PushAborted:
    request_id: str
    reason: str


@dataclass(frozen=True)
class PushCancelled:
    request_id: str
    reason: str


@dataclass(frozen=True)
class PushSettled:
    request_id: str
    reason: str


@dataclass(frozen=True)
class WarmUp:
    pass


Message = Union[ChunkDone, PushAborted, PushCancelled, PushSettled, WarmUp]


def encode(msg: Message) -> bytes:
    if isinstance(msg, ChunkDone):
        d = {"t": "c", "r": msg.request_id, "i": msg.index}
        if msg.count is not None:
            d["n"] = msg.count
            d["p"] = msg.pages
    elif isinstance(msg, PushAborted):
        d = {"t": "a", "r": msg.request_id, "m": msg.reason}
    elif isinstance(msg, PushCancelled):
        d = {"t": "x", "r": msg.request_id, "m": msg.reason}
    elif isinstance(msg, PushSettled):
        d = {"t": "s", "r": msg.request_id, "m": msg.reason}
    elif isinstance(msg, WarmUp):
        d = {"t": "w", "r": ""}
    else:
        raise TypeError(f"not a transfer message: {msg!r}")
    return PREFIX + json.dumps(d, separators=(",", ":")).encode()


def decode(raw: bytes) -> Optional[Message]:
    """The message in ``raw``, or None when it is not one of ours (or malformed)."""
    if not raw.startswith(PREFIX):
        return None
    try:
        d = json.loads(raw[len(PREFIX):])
        t, rid = d["t"], str(d["r"])
        if t == "c":
            n = d.get("n")
            return ChunkDone(rid, int(d["i"]), None if n is None else int(n), None if n is None else int(d["p"]))
        if t == "a":
            return PushAborted(rid, str(d["m"]))
        if t == "x":
            return PushCancelled(rid, str(d["m"]))
        if t == "s":
            return PushSettled(rid, str(d["m"]))
        if t == "w":
            return WarmUp()
    except (ValueError, KeyError, TypeError):
        pass
    return None
