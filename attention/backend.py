"""Attention backend registry.

``get_backend("reference")`` returns the pure-torch backend (runs on CPU; the
executable spec). ``get_backend("cuda")`` returns the flash_mla / deep_gemm /
triton backend (:mod:`attention.cuda.backend`), or raises
:class:`BackendUnavailableError` where those packages cannot be imported
(e.g. on a CPU-only machine).

Model code holds one :class:`AttentionBackend` and calls its functions; the
signatures are those of :mod:`attention.indexer`, :mod:`attention.sparse_mla`
and :mod:`attention.formats` (see ``attention/API.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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
    # Additions (defaults = the reference behaviour, so older constructions keep working):
    write_mla: Callable = None  # (cache, layer, slots, latent, rope) -> None; default cache.write_mla
    write_index: Callable = None  # (cache, layer, slots, k) -> None; default cache.write_index
    ragged_topk: Callable = None  # ragged logits + top-k -> (positions, slots); see attention/API.md
    check_cache_spec: Callable = None  # (CacheSpec) -> None; raises ValueError if unsupported

    def __post_init__(self) -> None:
        defaults = {
            "write_mla": _write_mla,
            "write_index": _write_index,
            "ragged_topk": _reference_ragged_topk,
            "check_cache_spec": _accept_any_spec,
        }
        for field, fn in defaults.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, fn)


def _write_mla(cache, layer, slots, latent, rope) -> None:
    cache.write_mla(layer, slots, latent, rope)


def _write_index(cache, layer, slots, k) -> None:
    cache.write_index(layer, slots, k)


def _accept_any_spec(spec) -> None:
    return None


def _reference_ragged_topk(q, k, k_scale, weights, ks, ke, topk, page_table_rows=None, **_):
    """``topk_slots(ragged_mqa_logits(q, k, k_scale, weights, ks, ke), ke, topk, page_table_rows)``."""
    logits = indexer.ragged_mqa_logits(q, k, k_scale, weights, ks, ke)
    lengths = torch.as_tensor(ke, device=logits.device).reshape(-1).long().clamp(0, logits.shape[1])
    return indexer.topk_slots(logits, lengths, topk, page_table_rows)


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
_CUDA: AttentionBackend | None = None


def get_backend(name: str) -> AttentionBackend:
    """The backend called ``name``.

    Raises:
        BackendUnavailableError: (a ``NotImplementedError``) for ``"cuda"`` where
            triton, flash_mla or deep_gemm cannot be imported.
        ValueError: for an unknown name.
    """
    global _CUDA
    if name == "reference":
        return _REFERENCE
    if name == "cuda":
        if _CUDA is None:
            try:
                from .cuda import _ext

                _ext.flash_mla()
                _ext.deep_gemm()
                from .cuda.backend import make_backend
            except ImportError as exc:
                raise BackendUnavailableError(
                    "the 'cuda' attention backend needs flash_mla (sgl-flash-mla==1.0.0) and deep_gemm "
                    "(sgl-deep-gemm==0.1.4) on a CUDA GPU, and triton; use get_backend('reference') "
                    f"(pure torch, CPU) here. Cause: {exc}"
                ) from exc
            _CUDA = make_backend("cuda")
        return _CUDA
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
