"""Deterministic random prompts for the worker tests."""

from __future__ import annotations

import torch


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` token ids in ``[2, vocab)`` (0/1 are BOS/EOS in the tiny configs)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()
