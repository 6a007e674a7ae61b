"""A request's life in one replica: tokens, pages, sampling state, MTP state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from workers.sample.params import SamplingParams
from workers.sample.prompt_logprobs import PromptLogprobs


class RequestState(Enum):
    WAITING = "waiting"            # queued, no pages yet
    PREFILLING = "prefilling"      # pages held, prompt chunks being computed
    AWAITING_KV = "awaiting_kv"    # decode side of PD: pages reserved, transfer in flight
    RUNNING = "running"            # in the decode batch
    FINISHED = "finished"


class FinishReason(str, Enum):
    LENGTH = "length"     # max_new_tokens reached
    STOP = "stop"         # EOS, a stop token id or a stop string
    ABORT = "abort"       # aborted by the caller (client disconnect, cancel)
    ERROR = "error"       # transfer failure, rejected at admission, ...


UNAVAILABLE = "unavailable:"
"""Prefix of the error of a request ended by a fault of the serving system, not by the request (a
replica died, a KV transfer failed or expired): the ingress answers 503 and the client may retry
it as it is, where any other error is the request's own (or a bug: 500)."""


def unavailable(detail: str) -> str:
    """The error message of a request ended by a fault (``UNAVAILABLE``)."""
    return f"{UNAVAILABLE} {detail}"


# eq=False: a request is an entity, equal only to itself. The generated
# field-by-field __eq__ made every `req in running` in the scheduler compare
# prompts and outputs: O(batch^2) list compares per step, half the engine
# thread's time at batch 128 when served (py-spy, H100, session 11).
@dataclass(eq=False)
class Request:
    """One generation request.

    ``num_computed``: tokens of ``token_ids`` whose target KV is in the cache.
    ``pending_hidden``: fp32/dtype ``[m, hidden]`` target hidden states of
    positions ``[pending_start, pending_start + m)`` whose MTP cache entries are
    not written yet (the MTP layer needs the *next* token of each, known only
    after it is sampled or accepted).
    ``drafts``: draft tokens proposed for the next verify step, with
    ``draft_probs`` (``[k, vocab]`` fp32 on the logits' device, sampling mode only).
    ``seed`` / ``rng_offset``: the request's random stream and how many draws
    of it are used (``workers.sample.ops.rng``): ``params.seed``, or one the
    engine draws at admission; a prefilled request brings both from prefill.
    ``prompt_logprobs``: filled by the prefill pass when ``params.prompt_logprobs``
    asks (a prefilled request brings prefill's); sent with the first token.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    state: RequestState = RequestState.WAITING
    page_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    seed: int | None = None
    rng_offset: int = 0
    pending_hidden: torch.Tensor | None = None
    pending_start: int = 0
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    arrival: int = 0
    grammar: Any = None
    """The request's `workers.structured.GrammarMatcher` when ``params.grammar`` is set (made by the
    engine that decodes it; fed every token the request generated, on any replica)."""
    prompt_logprobs: PromptLogprobs | None = None
    cached_pages: int = 0
    prefix_keys: tuple[int, list[bytes]] | None = None
    """``(n, keys)``: the prefix-cache keys of the first ``n`` tokens' full pages, computed once per
    admission length (`workers.scheduler.Scheduler` defers a request behind one computing its prefix)."""
    """Leading pages of ``page_table`` a decode replica took from its prefix cache when it reserved them
    (PD: prefill does not push them)."""
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if self.seed is None:
            self.seed = self.params.seed
        if self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs.wanted(self.params, len(self.prompt))

    def prompt_ids(self) -> torch.Tensor:
        """int64 ``[len(prompt)]`` on the host, made once (the repetition penalty reads it every step)."""
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(self.prompt, dtype=torch.int64)
        return self._prompt_ids

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        """The newest token (without building ``token_ids``: that copies the whole context)."""
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.state, self.finish_reason, self.error = RequestState.FINISHED, reason, error
