"""Sparse MLA of the ``cuda`` backend: FlashMLA's sparse prefill and fp8 sparse decode.

Both wrappers take the reference's arguments (:mod:`attention.sparse_mla`)
and adapt them to what the SM90 ("legacy") kernels of sgl-flash-mla 1.0.0
accept:

* ``use_legacy=True`` (the SM90 kernels), ``d_qk = 576`` (kv_lora_rank 512 +
  rope 64), ``d_v = 512``;
* query heads padded with zero heads to 64 or 128 (the only head counts the
  kernels take; a tensor-parallel shard of 16 or 32 heads is padded to 64),
  and the padded heads' outputs dropped;
* top-k widths padded with ``-1`` to a multiple of 128 (the kernels tile top-k
  in blocks; a tiny model's top-k of 16 becomes 128);
* decode reads the fp8 pool through its ``(num_pages, 64, 1, 656)`` view with
  ``is_fp8_kvcache=True`` and sparse indices ``page * 64 + offset``. The
  decode kernel does no bounds check, so every index outside
  ``[0, num_pages * 64)`` is turned into ``-1`` on the device first.

Outputs are the kernels' bf16 (the reference returns f32); lse / max_logits
are f32 in natural-log units, as the reference's.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import _ext

KV_LORA_RANK = 512
ROPE_DIM = 64
D_QK = KV_LORA_RANK + ROPE_DIM
D_V = KV_LORA_RANK
TOPK_ALIGN = 128
_HEAD_SIZES = (64, 128)


def padded_heads(h: int) -> int:
    """The FlashMLA head count a shard of ``h`` heads runs at (64 or 128)."""
    for size in _HEAD_SIZES:
        if h <= size:
            return size
    raise ValueError(f"FlashMLA's sparse kernels take at most 128 query heads per call, got {h} "
                     "(shard the heads with tensor parallelism)")


def padded_topk(topk: int) -> int:
    return max(TOPK_ALIGN, -(-topk // TOPK_ALIGN) * TOPK_ALIGN)


def check_mla_dims(kv_lora_rank: int, rope_dim: int, d_v: int | None = None) -> None:
    """Raise unless the dims are the ones the FlashMLA kernels are built for."""
    if kv_lora_rank != KV_LORA_RANK or rope_dim != ROPE_DIM:
        raise ValueError(
            f"the cuda backend's sparse MLA (FlashMLA) needs kv_lora_rank = {KV_LORA_RANK} and "
            f"qk_rope_head_dim = {ROPE_DIM} (576-dim keys); got kv_lora_rank = {kv_lora_rank}, "
            f"qk_rope_head_dim = {rope_dim}"
        )
    if d_v is not None and d_v != D_V:
        raise ValueError(f"FlashMLA's sparse kernels need d_v = {D_V}, got {d_v}")


def _pad_heads(q: torch.Tensor, h_pad: int) -> torch.Tensor:
    """bf16 ``q [..., h, D]`` -> contiguous ``[..., h_pad, D]`` with zero heads appended."""
    h = q.shape[-2]
    if h == h_pad:
        return q.to(torch.bfloat16).contiguous()
    out = torch.zeros(*q.shape[:-2], h_pad, q.shape[-1], dtype=torch.bfloat16, device=q.device)
    out[..., :h, :] = q
    return out


def _pad_indices(idx: torch.Tensor, width: int, invalid: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., topk]`` -> contiguous ``[..., width]``; ``invalid`` entries and the padding are -1."""
    out = torch.full((*idx.shape[:-1], width), -1, dtype=torch.int32, device=idx.device)
    out[..., : idx.shape[-1]] = torch.where(invalid, -1, idx).to(torch.int32)
    return out


# --------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention.sparse_mla.sparse_mla_prefill`` on ``flash_mla.flash_mla_sparse_fwd``.

    ``q [s, h, 576]`` (any float; cast to bf16), ``kv [s_kv, 1, 576]`` (or
    ``[s_kv, 576]``), ``indices [s, 1, topk]`` (or ``[s, topk]``) positions into
    kv, ``< 0`` or ``>= s_kv`` invalid. Returns ``(out bf16 [s, h, 512],
    max_logits f32 [s, h], lse f32 [s, h])``; a row without a valid index gets
    out 0, max_logits -inf, lse +inf.
    """
    if q.dim() != 3:
        raise ValueError(f"expected q [s, h, D], got {tuple(q.shape)}")
    s, h, dim = q.shape
    if dim != D_QK:
        raise ValueError(f"the cuda backend's sparse MLA needs 576-dim queries (kv_lora_rank 512 + rope 64), "
                         f"got {dim}")
    check_mla_dims(KV_LORA_RANK, ROPE_DIM, D_V if d_v is None else d_v)
    if kv.dim() == 2:
        kv = kv[:, None, :]
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != dim:
        raise ValueError(f"expected kv [s_kv, 1, {dim}], got {tuple(kv.shape)}")
    if indices.dim() == 2:
        indices = indices[:, None, :]
    if indices.dim() != 3 or indices.shape[:2] != (s, 1):
        raise ValueError(f"expected indices [{s}, 1, topk], got {tuple(indices.shape)}")
    s_kv, topk = kv.shape[0], indices.shape[2]
    dev = q.device
    if s == 0 or s_kv == 0 or topk == 0:
        # Nothing to attend to (or no rows): the kernels' empty-row convention.
        return (
            torch.zeros(s, h, D_V, dtype=torch.bfloat16, device=dev),
            torch.full((s, h), float("-inf"), dtype=torch.float32, device=dev),
            torch.full((s, h), float("inf"), dtype=torch.float32, device=dev),
        )
    h_pad = padded_heads(h)
    qb = _pad_heads(q, h_pad)
    kvb = kv.to(torch.bfloat16).contiguous()
    idx = _pad_indices(indices, padded_topk(topk), (indices < 0) | (indices >= s_kv))
    fm = _ext.flash_mla()
    out, max_logits, lse = fm.flash_mla_sparse_fwd(qb, kvb, idx, float(sm_scale), D_V, use_legacy=True)
    if h_pad != h:
        out, max_logits, lse = out[:, :h], max_logits[:, :h], lse[:, :h]
    return out, max_logits, lse


# --------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------


class _SchedMetaCache:
    """FlashMLA scheduling metadata, one object per (device, b, s_q, h, topk).

    The object may be reused while the shapes (and the absent topk_length)
    stay the same -- what it depends on -- so every layer of every step with
    the same batch shape shares one.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._items: OrderedDict[tuple, object] = OrderedDict()
        self.capacity = capacity

    def get(self, key: tuple):
        meta = self._items.get(key)
        if meta is None:
            meta = _ext.flash_mla().get_mla_metadata()[0]
            self._items[key] = meta
            if len(self._items) > self.capacity:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return meta

    def clear(self) -> None:
        self._items.clear()


SCHED_META = _SchedMetaCache()


def sparse_mla_decode(
    q: torch.Tensor,
    cache,
    layer: int,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.sparse_mla.sparse_mla_decode`` on ``flash_mla.flash_mla_with_kvcache`` (fp8, sparse).

    ``q [b, s_q, h, 576]`` (s_q = 1 for decode, next_n for MTP verification),
    ``cache`` a :class:`~attention.cache.PagedKVCache` with
    ``kv_cache_dtype="fp8"`` and kv_lora_rank 512 / rope 64, ``indices
    [b, s_q, topk]`` slots (``-1`` invalid). Returns ``(out bf16 [b, s_q, h,
    512], lse f32 [b, h, s_q])``; a row without a valid index gets out 0.
    """
    spec = cache.spec
    if not spec.is_fp8:
        raise ValueError("the cuda backend's sparse decode reads the fp8 MLA cache (kv_cache_dtype='fp8'); "
                         f"got kv_cache_dtype={spec.kv_cache_dtype!r}")
    check_mla_dims(spec.kv_lora_rank, spec.rope_dim, D_V if d_v is None else d_v)
    if q.dim() != 4 or q.shape[-1] != D_QK:
        raise ValueError(f"expected q [b, s_q, h, {D_QK}], got {tuple(q.shape)}")
    b, s_q, h, _ = q.shape
    if indices.dim() != 3 or indices.shape[:2] != (b, s_q):
        raise ValueError(f"expected indices [{b}, {s_q}, topk], got {tuple(indices.shape)}")
    topk = indices.shape[2]
    dev = q.device
    if b == 0 or s_q == 0 or topk == 0:
        return (torch.zeros(b, s_q, h, D_V, dtype=torch.bfloat16, device=dev),
                torch.full((b, h, s_q), float("inf"), dtype=torch.float32, device=dev))
    h_pad = padded_heads(h)
    topk_pad = padded_topk(topk)
    qb = _pad_heads(q, h_pad)
    idx = torch.as_tensor(indices, device=dev)
    idx = _pad_indices(idx, topk_pad, (idx < 0) | (idx >= spec.num_slots))
    kcache = cache.mla_view_for_kernel(layer)
    fm = _ext.flash_mla()
    meta = SCHED_META.get((dev.type, dev.index, b, s_q, h_pad, topk_pad))
    out, lse = fm.flash_mla_with_kvcache(
        qb, kcache, None, None, D_V, meta,
        softmax_scale=float(sm_scale), is_fp8_kvcache=True, indices=idx, use_legacy=True,
    )
    if h_pad != h:
        out, lse = out[:, :, :h], lse[:, :h]
    return out, lse
