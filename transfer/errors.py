"""Errors raised by `transfer/`.

Transport failures of one request never raise out of `Pusher` / `Receiver`
polling: they become a failed result for that request (see `push.PushResult`,
`receiver.ReceiveResult`). The exceptions here are for caller mistakes
(bad regions, bad page lists) and for peers that must not be talked to
(incompatible, unknown or stale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TransferError(Exception):
    """Base class of every error raised by `transfer/`."""


class RegionError(TransferError, ValueError):
    """A cache region cannot be registered as given (layout, size, overlap, duplicate key)."""


class PlanError(TransferError, ValueError):
    """A transfer plan cannot be built from the given pages (count, range, duplicates, geometry)."""


@dataclass(frozen=True)
class FieldDiff:
    """One field on which the local and the remote side disagree."""

    field: str
    local: Any
    remote: Any

    def __str__(self) -> str:
        return f"{self.field}: local={self.local!r} remote={self.remote!r}"


class CompatibilityError(TransferError):
    """The peer's compatibility hash differs; ``diffs`` names every differing field."""

    def __init__(self, peer: str, diffs: list[FieldDiff]):
        self.peer = peer
        self.diffs = tuple(diffs)
        detail = "; ".join(str(d) for d in diffs)
        super().__init__(f"peer {peer!r} is incompatible: {detail}")

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(d.field for d in self.diffs)


class UnknownPeerError(TransferError, LookupError):
    """No handshake with this agent (or it belongs to a dead epoch): handshake again."""


class StaleEpochError(TransferError):
    """A handshake offer from an older epoch of a worker whose newer epoch is already known."""


class RequestCancelledError(TransferError):
    """`Pusher.begin` of a request its decode peer already cancelled (its cancel arrived first).

    Prefill answered that cancel with "nothing in flight", so decode may have
    re-used the pages: pushing now would write into another request's pages.
    """
