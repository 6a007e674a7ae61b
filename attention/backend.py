"""Attention backend registry.

``get_backend("reference")`` returns the pure-torch backend (runs on CPU; the
executable spec). ``get_backend("cuda")`` will return the flash_mla / deep_gemm
/ triton backend once it exists; until then it raises
:class:`BackendUnavailableError`.

Model code holds one :class:`AttentionBackend` and calls its functions; the
signatures are those of :mod:`attention.indexer`, :mod:`attention.sparse_mla`
and :mod:`attention.formats` (see ``attention/API.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import formats, indexer, sparse_mla


class BackendUnavailableError(NotImplementedError):
    """The requested backend exists in name but cannot be used here."""


@dataclass(frozen=True)
class AttentionBackend:
    """The functions one backend provides (same signatures in every backend)."""

    name: str
    paged_mqa_logits: Callable
    ragged_mqa_logits: Callable
    topk_slots: Callable
    sparse_mla_decode: Callable
    sparse_mla_prefill: Callable
    quantize_mla_fp8: Callable
    dequantize_mla_fp8: Callable
    quantize_indexer_fp8: Callable
    dequantize_indexer_fp8: Callable


_REFERENCE = AttentionBackend(
    name="reference",
    paged_mqa_logits=indexer.paged_mqa_logits,
    ragged_mqa_logits=indexer.ragged_mqa_logits,
    topk_slots=indexer.topk_slots,
    sparse_mla_decode=sparse_mla.sparse_mla_decode,
    sparse_mla_prefill=sparse_mla.sparse_mla_prefill,
    quantize_mla_fp8=formats.quantize_mla_fp8,
    dequantize_mla_fp8=formats.dequantize_mla_fp8,
    quantize_indexer_fp8=formats.quantize_indexer_fp8,
    dequantize_indexer_fp8=formats.dequantize_indexer_fp8,
)

BACKEND_NAMES = ("reference", "cuda")


def get_backend(name: str) -> AttentionBackend:
    """The backend called ``name``.

    Raises:
        BackendUnavailableError: (a ``NotImplementedError``) for ``"cuda"``, which
            is not built yet.
        ValueError: for an unknown name.
    """
    if name == "reference":
        return _REFERENCE
    if name == "cuda":
        raise BackendUnavailableError(
            "the 'cuda' attention backend is not implemented yet: it needs flash_mla "
            "(sgl-flash-mla==1.0.0) and deep_gemm (sgl-deep-gemm==0.1.4) on a CUDA GPU; "
            "use get_backend('reference') (pure torch, CPU) meanwhile"
        )
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
