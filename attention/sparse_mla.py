"""Sparse MLA attention, reference backend (fp32 torch).

Each query row attends only to the ``topk`` keys its indexer chose. MLA in
absorbed form: a key is the token's ``[latent (r) | rope (d)]`` vector (576 for
DeepSeek-V3.2), the value is its first ``d_v`` (= r) elements, one KV head
shared by all query heads::

    logit[h, i] = sm_scale * q[h] . kv[idx[i]]          (idx[i] invalid -> excluded)
    lse[h]      = ln sum_i exp(logit[h, i])             (natural log)
    out[h]      = sum_i exp(logit[h, i] - lse[h]) * kv[idx[i], :d_v]

A row with no valid index gets ``out = 0``, ``lse = +inf`` (and for prefill
``max_logits = -inf``): the convention of FlashMLA's kernels (pinned for prefill
by ``shared/golden/flashmla_sparse_prefill``; decode uses the same).

Computed in fp32 from the exact cache contents (fp8 values times their fp32
tile scale). Measured against FlashMLA's legacy SM90 fp8 decode kernel
(``shared/golden/flashmla_sparse_decode_v32``): that kernel rounds each tile
scale to bf16 and the dequantized key to bf16 before its bf16 matmuls, so its
lse differs from this fp32 reference by up to ~3e-3 (and by ~1e-6 if the
rounding is emulated), out by ~3e-3 relative (Frobenius).
"""

from __future__ import annotations

import torch

from .cache import PagedKVCache

# Rows per chunk are chosen so one chunk's gathered keys stay near this many
# float32 elements (~256 MiB): long prefills must not materialise
# [s, topk, 576] at once.
_CHUNK_ELEMENTS = 64 * 1024 * 1024


def _attend(
    q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Core softmax attention of independent rows.

    Args:
        q: f32 ``[n, h, D]``; k: f32 ``[n, topk, D]`` (garbage where invalid);
        valid: bool ``[n, topk]``.

    Returns:
        ``(out f32 [n, h, d_v], max_logits f32 [n, h], lse f32 [n, h])`` in
        natural-log units of the scaled logits; empty rows -> 0, -inf, +inf.
    """
    logits = torch.einsum("nhd,ntd->nht", q, k) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    max_logits = logits.amax(dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    empty = ~valid.any(dim=-1)  # [n]
    # exp(-inf - finite) = 0 for invalid keys; empty rows would give NaN (-inf - -inf): zero them.
    p = torch.exp(logits - lse.masked_fill(empty[:, None], 0.0)[..., None])
    out = torch.einsum("nht,ntv->nhv", p, k[..., :d_v])
    out = out.masked_fill(empty[:, None, None], 0.0)
    lse = lse.masked_fill(empty[:, None], float("inf"))
    return out, max_logits, lse


def _rows_per_chunk(topk: int, dim: int, h: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, topk * (dim + h)))


def sparse_mla_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over the paged cache (FlashMLA ``flash_mla_with_kvcache``, sparse).

    Args:
        q: ``[b, s_q, h, r + d]`` float (bf16 in production), absorbed queries.
        cache: the paged cache (fp8 or auto); keys are read with
            :meth:`PagedKVCache.read_mla` (dequantized to f32).
        layer: cache layer.
        indices: int ``[b, s_q, topk]`` slots (``page * 64 + offset``), ``-1`` invalid.
        sm_scale: softmax scale applied to ``q . k``.
        d_v: value width, default ``r`` (kv_lora_rank).

    Returns:
        ``(out f32 [b, s_q, h, d_v], lse f32 [b, h, s_q])``, lse in natural log
        (FlashMLA's layout: heads before query positions). A row whose indices
        are all -1 gets out 0 and lse +inf.
    """
    spec = cache.spec
    dim = spec.kv_lora_rank + spec.rope_dim
    d_v = spec.kv_lora_rank if d_v is None else d_v
    if q.dim() != 4 or q.shape[-1] != dim:
        raise ValueError(f"expected q [b, s_q, h, {dim}], got {tuple(q.shape)}")
    b, s_q, h, _ = q.shape
    if indices.dim() != 3 or indices.shape[:2] != (b, s_q):
        raise ValueError(f"expected indices [{b}, {s_q}, topk], got {tuple(indices.shape)}")
    if not 0 < d_v <= dim:
        raise ValueError(f"d_v must be in (0, {dim}], got {d_v}")
    topk = indices.shape[2]
    rows_q = q.reshape(b * s_q, h, dim).float()
    rows_idx = indices.reshape(b * s_q, topk).long()
    outs, lses = [], []
    step = _rows_per_chunk(topk, dim, h)
    for start in range(0, b * s_q, step):
        idx = rows_idx[start : start + step]
        k = cache.read_mla(layer, idx.reshape(-1)).view(idx.shape[0], topk, dim)
        out, _, lse = _attend(rows_q[start : start + step], k, idx >= 0, sm_scale, d_v)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs).view(b, s_q, h, d_v)
    lse = torch.cat(lses).view(b, s_q, h).transpose(1, 2).contiguous()
    return out, lse


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill over contiguous keys (FlashMLA ``flash_mla_sparse_fwd``).

    Args:
        q: ``[s, h, r + d]`` float (bf16 in production).
        kv: ``[s_kv, 1, r + d]`` float (``[s_kv, r + d]`` accepted too).
        indices: int ``[s, 1, topk]`` (``[s, topk]`` accepted) positions into kv;
            ``< 0`` or ``>= s_kv`` are invalid.
        sm_scale: softmax scale applied to ``q . k``.
        d_v: value width = kv_lora_rank. It cannot be inferred from the shapes,
            so it must be given unless ``r + d == 576`` (then it defaults to 512).

    Returns:
        ``(out f32 [s, h, d_v], max_logits f32 [s, h], lse f32 [s, h])``.
        ``max_logits`` is the max of the *scaled* logits (``sm_scale * q . k``) and
        ``lse`` their natural-log logsumexp: the legacy SM90 kernel returns both
        in natural-log units (verified against ``shared/golden``: matches to
        ~4e-6; neither is in base 2 nor unscaled). A row with no valid index gets
        out 0, max_logits -inf, lse +inf.
    """
    if q.dim() != 3:
        raise ValueError(f"expected q [s, h, D], got {tuple(q.shape)}")
    s, h, dim = q.shape
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"expected kv [s_kv, 1, D] (one latent head), got {tuple(kv.shape)}")
        kv = kv[:, 0]
    if kv.dim() != 2 or kv.shape[1] != dim:
        raise ValueError(f"expected kv [s_kv, {dim}], got {tuple(kv.shape)}")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"expected indices [s, 1, topk], got {tuple(indices.shape)}")
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[0] != s:
        raise ValueError(f"expected indices [{s}, 1, topk], got {tuple(indices.shape)}")
    if d_v is None:
        if dim != 576:
            raise ValueError("d_v must be given unless q's width is 576 (kv_lora_rank 512 + rope 64)")
        d_v = 512
    if not 0 < d_v <= dim:
        raise ValueError(f"d_v must be in (0, {dim}], got {d_v}")
    s_kv, topk = kv.shape[0], indices.shape[1]
    kv = kv.float()
    qf = q.float()
    idx_all = indices.long()
    outs, maxes, lses = [], [], []
    step = _rows_per_chunk(topk, dim, h)
    for start in range(0, s, step):
        idx = idx_all[start : start + step]
        valid = (idx >= 0) & (idx < s_kv)
        if s_kv:
            k = kv[idx.clamp(0, s_kv - 1)]
        else:  # no keys at all: every index is invalid
            k = kv.new_zeros(*idx.shape, dim)
        out, mx, lse = _attend(qf[start : start + step], k, valid, sm_scale, d_v)
        outs.append(out)
        maxes.append(mx)
        lses.append(lse)
    return torch.cat(outs), torch.cat(maxes), torch.cat(lses)
