"""The checkpoint's tokenizer, seen as the engine needs it: ids -> text."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def load_detokenizer(model_dir: str | Path) -> Callable[[list[int]], str] | None:
    """``ids -> text`` from the checkpoint's tokenizer (the engine matches stop
    strings on it); None for a token-id-only checkpoint (stop strings are then refused)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
    return lambda ids: tok.decode(ids)
