"""Byte formats of every paged cache (DESIGN.md, "Byte formats").

The page geometry here is the single source of truth: the model runner, the
page pool and the NIXL transfer plan all call these helpers instead of doing
their own arithmetic.
"""

from __future__ import annotations

PAGE_SIZE = 64
"""Tokens per page, shared by every cache (MLA latent, indexer keys, state pages)."""


def pages_for_tokens(num_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``.

    Prefill and decode both call this with the *prompt* length when they agree
    on the pages of a transfer; computing it from prompt + sampled token is a
    known cross-engine off-by-one.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // page_size)
