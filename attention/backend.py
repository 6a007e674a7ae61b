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
    # (max_context tokens) -> ascending logits widths, the last max_context: the context classes a captured
    # decode step gets a graph of its own for, because this backend's kernels differ between them.
    decode_logits_widths: Callable = None

    def __post_init__(self) -> None:
        defaults = {
            "write_mla": _write_mla,
            "write_index": _write_index,
            "ragged_topk": _reference_ragged_topk,
            "check_cache_spec": _accept_any_spec,
            "decode_logits_widths": _one_width,
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


def _one_width(max_context: int) -> tuple[int, ...]:
    return (max_context,)


def _reference_ragged_topk(q, k, k_scale, weights, ks, ke, topk, page_table_rows=None, **_):
    """``topk_slots(ragged_mqa_logits(q, k, k_scale, weights, ks, ke), ke, topk, page_table_rows)``.

    Without page tables (positions are the slots: packed prefill rows), computed run by run of rows
    sharing a window start (one packed request's rows) over that run's keys only: the same result
    (each row's selection depends on its own window alone), holding one request's logits at a time
    instead of ``[all rows, all packed keys]``."""
    if page_table_rows is not None:
        logits = indexer.ragged_mqa_logits(q, k, k_scale, weights, ks, ke)
        lengths = torch.as_tensor(ke, device=logits.device).reshape(-1).long().clamp(0, logits.shape[1])
        return indexer.topk_slots(logits, lengths, topk, page_table_rows)
    ks_l = torch.as_tensor(ks).reshape(-1).tolist()
    ke_t = torch.as_tensor(ke, device=q.device).reshape(-1).long()
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    r0 = 0
    while r0 < len(ks_l):
        r1 = r0 + 1
        while r1 < len(ks_l) and ks_l[r1] == ks_l[r0]:
            r1 += 1
        k0 = max(0, min(ks_l[r0], k.shape[0]))
        k1 = max(k0, min(int(ke_t[r0:r1].max()), k.shape[0]))
        logits = indexer.ragged_mqa_logits(q[r0:r1], k[k0:k1], None if k_scale is None else k_scale[k0:k1],
                                           weights[r0:r1], torch.zeros(r1 - r0, dtype=torch.long),
                                           (ke_t[r0:r1] - k0).clamp(0, k1 - k0))
        pos, _ = indexer.topk_slots(logits, (ke_t[r0:r1] - k0).clamp(0, k1 - k0), topk, None)
        out[r0:r1] = torch.where(pos >= 0, pos + k0, -1)
        r0 = r1
    return out, out.clone()


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
