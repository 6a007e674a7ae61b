"""Presence, frequency and repetition penalties on a batch of logits.

Semantics: repetition (HF / vLLM) over prompt + generated tokens, then
frequency and presence (OpenAI) over the generated tokens, on the raw logits.
"""

from __future__ import annotations

import torch


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 ``[N, vocab]``: how often each token occurs in each row of ``ids``
    (int64 ``[N, L]``, padded with -1, which counts nowhere)."""
    n = ids.shape[0]
    counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=ids.device)
    # Padding goes to an extra column that is dropped: no masking pass, no host read.
    cols = torch.where(ids < 0, vocab, ids)
    counts.scatter_add_(1, cols, torch.ones_like(cols, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalised fp32 logits ``[N, V]`` (a new tensor).

    output_counts: fp32 ``[N, V]`` occurrences among the generated tokens;
    seen: bool ``[N, V]`` the token occurs in the prompt or the generated
    tokens; presence / frequency / repetition: fp32 ``[N]`` per row (0, 0, 1
    leave a row unchanged, bit for bit).
    """
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).float()
