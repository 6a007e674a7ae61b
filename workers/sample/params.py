"""What a request asks of the sampler: `SamplingParams` (validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from workers.structured.spec import GrammarSpec

MAX_LOGPROBS = 20
"""Most top log-probabilities a request may ask for per token (OpenAI's chat limit)."""


GREEDY_BELOW = 1e-5
"""Temperatures below this sample as greedy (argmax): fp32 logits divided by less overflow."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature: 0 (or below `GREEDY_BELOW`) = greedy (argmax), else logits are divided by it before the
    truncations. top_k (0 = off), min_p (0 = off) and top_p (1 = off) truncate
    the distribution: top-k and min-p first (min-p keeps tokens whose
    probability is at least ``min_p`` times the most likely one's), then top-p
    keeps the smallest most-likely prefix of the renormalised rest whose mass
    reaches ``top_p`` (vLLM's order).
    presence_penalty / frequency_penalty (OpenAI semantics, over the generated
    tokens): ``logit -= presence * (count > 0) + frequency * count``.
    repetition_penalty (HF / vLLM semantics, over prompt + generated tokens):
    a seen token's positive logit is divided by it, a negative one multiplied.
    Penalties apply to the raw logits, before temperature, greedy included.
    seed: the request's random stream (any int, used modulo 2**64); None = one
    drawn when the request is admitted.
    logprobs: how many most likely tokens' log-probabilities to return per
    token besides the chosen one's (which is always returned); None = only the
    chosen token's.
    prompt_logprobs: None = none; N = every prompt position's own token's
    log-probability and the N most likely tokens there (0 = only the
    token's own), computed in the prefill pass
    (`workers.sample.prompt_logprobs`; OpenAI's ``echo`` with ``logprobs``).
    min_tokens: EOS (unless ``ignore_eos``) and ``stop_token_ids`` cannot be
    sampled before this many tokens were generated (vLLM's semantics; stop
    strings still stop). logit_bias: (token id, bias) pairs added to the raw
    logits before the penalties (OpenAI's ``logit_bias``, -100..100). Both
    change which token is chosen, never the reported log-probabilities
    (those of the raw logits).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    """Structured outputs: what the output must match (`workers.structured`); the request stops once
    the grammar is complete. Not with ``min_tokens`` (a complete grammar allows only EOS)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        for tok, bias in self.logit_bias:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or not math.isfinite(bias):
                raise ValueError(f"logit_bias entries must be (token id >= 0, finite bias), got {(tok, bias)!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise ValueError(f"grammar must be a GrammarSpec or None, got {self.grammar!r}")
            if self.min_tokens:
                # A complete grammar allows only EOS, which min_tokens would block: no token left to sample.
                raise ValueError("min_tokens cannot be combined with a grammar (structured outputs)")

    @property
    def greedy(self) -> bool:
        """Argmax. Temperatures below `GREEDY_BELOW` are greedy too: dividing fp32 logits by
        1e-300 makes them +-inf, and a draw over NaN probabilities picked token 0."""
        return self.temperature < GREEDY_BELOW

    @cached_property
    def uses_penalties(self) -> bool:
        """Any of the three penalties is on (the sampler then needs the token history). Cached: the
        engine asks for every running request every step."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """``logit_bias`` or ``min_tokens`` is set (the sampler then adds a sparse bias to some rows)."""
        return bool(self.logit_bias) or self.min_tokens > 0

    @property
    def top_logprobs(self) -> int:
        """Top log-probabilities wanted per token (0 = none)."""
        return self.logprobs or 0
