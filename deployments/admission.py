"""Admission: what the server takes on, and the 429 / 400 answers past it.

Overload is refused, never queued without bound (docs/reliability.md):

- **The ingress** holds at most ``limits.max_requests`` requests per replica
  (`InFlight`); one more is answered 429 at once. Since that default is
  twice what the decode role takes (Serve's ``max_ongoing_requests`` per
  decode replica), Serve's queue in the ingress's decode handle holds at most
  one decode capacity, and the queues of the decode replicas' prefill
  handles at most what their decode replica holds.
- **Every pool's queue** is bounded in time: a request carries ``admit_by``
  (wall-clock seconds, its arrival at the ingress plus
  ``limits.queue_timeout_s``), and a decode replica (waiting for pages, or
  in monolithic mode for the engine to start it) or a prefill replica
  (waiting for pages) refuses it once that passes. A refusal is an error
  output whose message starts with ``overloaded:`` (`overload_message`),
  which the ingress answers 429 with ``Retry-After`` and the replica counts
  in ``dsa_pd_rejections`` by reason (`overload_reason`).
- **A request that can never fit** a page pool (its prompt plus
  ``max_tokens``, with what MTP writes ahead) is answered 400 before it is
  routed, naming the pool and the sizes (`PoolFit`); a request without
  ``max_tokens`` is given what the pool can hold instead, as it is given
  what the context length leaves.

Ray-free: the replicas and the ingress import it, and so do the unit tests.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

from attention.cache_groups import CacheGroup
from attention.formats import PAGE_SIZE, pages_for_tokens
from deployments.app_config import AppConfig
from deployments.openai.errors import ContextLengthExceeded, Overloaded
from workers.v4_prefix import cut_tokens, tokens_with_cuts
from workers.scheduler import tokens_to_hold

__all__ = [
    "InFlight",
    "PoolFit",
    "Slot",
    "admit_by",
    "max_requests",
    "overload_message",
    "overload_reason",
    "queue_timeout_s",
    "timeout_detail",
    "waited",
]

OVERLOADED = "overloaded:"
"""Prefix of every overload refusal's message (an engine error output's ``error``)."""

_REASON_WORDS = {"pages": "page pool", "queue_timeout": "queue timeout"}
"""``dsa_pd_rejections`` reason -> the words of the message that carries it."""

MONOLITHIC_QUEUE_TIMEOUT_S = 60.0
"""Default ``queue_timeout_s`` without a prefill role (no transfer deadline to stay within)."""


def overload_message(role: str, reason: str, detail: str) -> str:
    """The ``error`` of a refusal by ``role``'s replica for ``reason`` (a key of ``_REASON_WORDS``)."""
    return f"{OVERLOADED} {role} {_REASON_WORDS[reason]}: {detail}"


def overload_reason(message: str | None) -> tuple[str, str] | None:
    """``(role, reason)`` of a message made by `overload_message` (None for any other)."""
    if not message or not message.startswith(OVERLOADED):
        return None
    role, _, rest = message[len(OVERLOADED):].strip().partition(" ")
    for reason, words in _REASON_WORDS.items():
        if rest.startswith(words + ":"):
            return role, reason
    return None


def queue_timeout_s(cfg: AppConfig) -> float:
    """``limits.queue_timeout_s`` or its default: half the transfer deadline (pd), 60 s (monolithic)."""
    if cfg.limits.queue_timeout_s is not None:
        return cfg.limits.queue_timeout_s
    return MONOLITHIC_QUEUE_TIMEOUT_S if cfg.monolithic else cfg.transfer.deadline_s / 2


STREAMS_PER_INGRESS = 32
"""Streams one ingress replica is sized for by default (`ingress_replicas`): on an H200, one replica
streaming 128 requests at the default pacing used a whole core (docs/perf.md, session 23)."""
MAX_DEFAULT_INGRESS = 8
"""The default's cap: each ingress replica holds the tokenizer and Serve's handles (about 0.7 GB of host memory
on an H200 host); Serve spreads replicas over the nodes."""


def ingress_replicas(cfg: AppConfig) -> int:
    """``ingress.num_replicas`` or its default: one per `STREAMS_PER_INGRESS` streams the decode role runs at
    once (its largest replica count x ``max_batch_size``), from 1 to `MAX_DEFAULT_INGRESS`."""
    if cfg.ingress.num_replicas is not None:
        return cfg.ingress.num_replicas
    d = cfg.decode
    return max(1, min(MAX_DEFAULT_INGRESS, -(-d.max_replicas * d.max_batch_size // STREAMS_PER_INGRESS)))


def max_requests(cfg: AppConfig) -> int:
    """Requests one ingress replica holds: ``limits.max_requests``, or its default: twice the decode role's
    replicas x ``max_ongoing_requests``, shared out over ``ingress.num_replicas`` (rounded up)."""
    if cfg.limits.max_requests is not None:
        return cfg.limits.max_requests
    d = cfg.decode
    return -(-2 * d.max_replicas * d.ongoing_requests_cap // ingress_replicas(cfg))


def admit_by(cfg: AppConfig, arrived: float | None = None) -> float:
    """The wall-clock time (``time.time()``: replicas on other nodes compare it) by which a request that
    ``arrived`` (default now) must have started."""
    return (time.time() if arrived is None else arrived) + queue_timeout_s(cfg)


def timeout_detail(timeout_s: float) -> str:
    """The detail of a queue-timeout refusal (`overload_message`)."""
    return f"not started within {timeout_s:g}s of its arrival; retry later"


def waited(admit: float | None, timeout_s: float, now: float | None = None) -> str | None:
    """The refusal detail of a request past its ``admit`` time (None while it may still wait)."""
    if admit is None or (time.time() if now is None else now) <= admit:
        return None
    return timeout_detail(timeout_s)


class Slot:
    """One request's place at the ingress; `release` (idempotent) gives it back."""

    __slots__ = ("_owner", "__weakref__")

    def __init__(self, owner: "InFlight"):
        self._owner: InFlight | None = owner

    def release(self) -> None:
        if self._owner is not None:
            self._owner.count -= 1
            self._owner = None


class InFlight:
    """The requests one ingress replica holds (all on its event loop: no lock)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def enter(self, holder: object | None = None) -> Slot:
        """A slot, or `Overloaded` when ``limit`` requests are held. With ``holder``, the slot is also
        released when ``holder`` is collected: a streamed response whose generator never ran (the client
        left before the first byte) runs no ``finally``."""
        if self.count >= self.limit:
            raise Overloaded(f"the server holds {self.count} requests, its limit (limits.max_requests); "
                             "retry later")
        self.count += 1
        slot = Slot(self)
        if holder is not None:
            weakref.finalize(holder, slot.release)
        return slot


@dataclass(frozen=True)
class PoolFit:
    """Whether a request can ever fit the page pools of one replica of each role.

    decode_pages: pages a request may use in a decode replica (the warm-up
    page left out in pd mode); prefill_pages: a prefill replica's (None in
    monolithic mode); draft_tokens: MTP drafts per step (cache positions
    written ahead of a request's length); groups: the model's cache groups
    (DeepSeek-V4: each group gets the role's ``num_pages``, counted by
    `workers.page_tables`' rule), empty for the one cache of 64-token pages.
    """

    decode_pages: int
    prefill_pages: int | None
    draft_tokens: int
    monolithic: bool
    groups: tuple[CacheGroup, ...] = ()
    cut_groups: tuple[str, ...] = ()
    """With DeepSeek-V4's prefix cache: the groups holding a page per 256-token cut too (`workers.v4_prefix`)."""

    @classmethod
    def of(cls, cfg: AppConfig, model_cfg=None) -> "PoolFit":
        """``model_cfg``: the checkpoint's parsed config (`models.registry.load_any_config`); a DeepSeek-V4
        one brings its cache groups."""
        from models.v4.config import V4Config

        mono = cfg.monolithic
        groups, cut_groups = (), ()
        if isinstance(model_cfg, V4Config):
            from models.v4.cache_spec import v4_cache_groups

            groups = tuple(v4_cache_groups(model_cfg, cfg.decode.kv_cache_dtype))
            if cfg.features.prefix_caching:
                from models.v4.cache_spec import cut_state_groups

                cut_groups = cut_state_groups(model_cfg)
        return cls(cfg.decode.num_pages - (0 if mono else 1), None if mono else cfg.prefill.num_pages,
                   cfg.decode.mtp_draft_tokens, mono, groups, cut_groups)

    def capacity(self, pages: int) -> int:
        """The most tokens one request's sequence may have in a pool of ``pages`` pages."""
        if not self.groups:
            return pages * PAGE_SIZE
        cut = cut_tokens(self.groups)
        bounds = [n for n in (tokens_with_cuts(g, pages, cut, self.cut_groups) for g in self.groups) if n is not None]
        return min(bounds) if bounds else 1 << 62

    def _pool_text(self, pages: int) -> str:
        if not self.groups:
            return f"{pages} pages of {PAGE_SIZE}"
        return f"{pages} pages in each of {len(self.groups)} cache groups, {self.capacity(pages)} tokens"

    def _hold(self, prompt: int, new: int) -> int:
        """Cache positions the decode replica holds for the request at most. Monolithic: what the engine's
        scheduler asks at admission (`workers.scheduler.Scheduler.add`); pd: a running request of at most
        prompt + new - 1 tokens (the last one is never fed) and what its next step writes."""
        return tokens_to_hold(prompt + new - (0 if self.monolithic else 1), self.draft_tokens)

    def fit(self, prompt: int, max_new: int, asked: bool, param: str) -> int:
        """The tokens to generate: ``max_new`` if the request fits, else 400 (`ContextLengthExceeded`)
        naming the pool. ``asked``: ``max_new`` is the client's ``max_tokens`` (else what the context
        length leaves, which is cut to what the decode pool holds). ``param``: prompt or messages."""
        if self.prefill_pages is not None and prompt > self.capacity(self.prefill_pages):
            raise ContextLengthExceeded(
                f"the {param} has {prompt} tokens{self._need_text(prompt)}; a prefill replica's page pool has "
                f"{self._pool_text(self.prefill_pages)}: it can never be served here", param=param)
        room = self.capacity(self.decode_pages) - self._hold(prompt, 0)
        if room < 1:
            raise ContextLengthExceeded(
                f"the {param} has {prompt} tokens; a decode replica's page pool "
                f"({self._pool_text(self.decode_pages)} for one request) cannot hold it and one generated "
                "token: it can never be served here", param=param)
        if max_new <= room:
            return max_new
        if not asked:
            return room
        hold = self._hold(prompt, max_new)
        need = f"{pages_for_tokens(hold)} pages of {PAGE_SIZE}" if not self.groups else f"{hold} tokens"
        raise ContextLengthExceeded(
            f"the request needs {need} ({prompt} {param} tokens + max_tokens {max_new}"
            f"{' + MTP positions' if self.draft_tokens else ''}); a decode replica's page pool has "
            f"{self._pool_text(self.decode_pages)} for one request: it can never be served here. Ask at most "
            f"{room} tokens.",
            param="max_tokens")

    def _need_text(self, prompt: int) -> str:
        return f", {pages_for_tokens(prompt)} pages of {PAGE_SIZE}" if not self.groups else ""
