"""The dtypes a config or the offline API may name for weights and activations: one table."""

from __future__ import annotations

from typing import Literal

import torch

DtypeName = Literal["float32", "bfloat16"]
"""What ``dtype`` fields accept (app config, offline ``LLM``, rank specs)."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``name``; a ValueError naming the choices for anything else."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def dtype_bytes(name: str) -> int:
    """Bytes per element of ``name`` (the controller's memory plan)."""
    return torch_dtype(name).itemsize
