"""Token sampling: greedy, temperature, top-k, top-p; seeded per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits ``[vocab]`` -> the distribution actually sampled from ``[vocab]``
    (temperature, then top-k, then top-p truncation, renormalised)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index from probabilities ``[n]`` with ``generator``.

    A request's generator lives on the host (its state crosses processes with
    a prefilled request), so probabilities computed on a GPU are drawn from on
    the host: the same seed then draws the same stream on any device.
    """
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from fp32 logits ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits))
    return draw(sampling_probs(logits, params), generator)
