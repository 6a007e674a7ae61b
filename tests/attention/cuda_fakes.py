"""Stand-ins for ``deep_gemm`` and ``flash_mla`` that run on CPU tensors.

They let CI exercise the *glue* of the cuda backend (layouts, padding, dtypes,
masking, chunking, metadata reuse) without a GPU: :func:`install` puts them
in ``sys.modules`` under the real names. Each fake

* asserts the argument contract the real SM90 kernel has (shapes, dtypes,
  contiguity, ``next_n`` in {1, 2}, 64/128 heads, top-k in blocks of 64, the
  metadata-reuse rule), so glue that would make the real kernel assert fails
  here too;
* computes its result with the torch reference (``attention.indexer``,
  ``attention.sparse_mla``) from the kernel's own inputs; ``flash_mla_with_kvcache``
  with ``kv_format="V4"`` (DeepSeek-V4 decode) reads each token's 576-byte part and
  8 scale bytes at the kernel's own offsets in the (P, 256, 1, 584) view (page
  stride from ``stride(0)``), dequantizes them with ``attention.v4_format`` and
  refuses metadata reused with other ``topk_length`` values (the real kernel
  silently uses the stale schedule);
* returns results shaped the way the real kernels return them: logits as a
  column slice of a row-padded buffer whose padding and (for paged logits,
  ``clean_logits=False``) whose tail past each row's length hold garbage
  (NaN and huge values), bf16 attention outputs.

What they cannot show: the real kernels' numerics and speed. The ``gpu``
tests in test_cuda_backend.py run the same checks against the real packages.
"""

from __future__ import annotations

import sys
import types

import torch

from attention import indexer as ref_indexer
from attention import sparse_mla as ref_mla
from attention.formats import PAGE_SIZE, MlaFp8Format, dequantize_mla_fp8
from attention.v4_format import V4CacheFormat

NUM_SMS = 132
CALLS: dict[str, int] = {}


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


def _garbage(shape) -> torch.Tensor:
    g = torch.full(shape, 3.0e38)
    g.view(-1)[::3] = float("nan")
    g.view(-1)[1::3] = -7.0
    return g


def _padded_logits(rows: int, width: int) -> torch.Tensor:
    """A garbage-filled buffer with DeepGEMM's padded row stride, sliced to ``[rows, width]``."""
    stride = -(-(width + 256) // 256) * 256
    return _garbage((rows + 1, stride))[:rows, :width]


# ----------------------------------------------------------------------------- deep_gemm


def get_num_sms() -> int:
    return NUM_SMS


def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None):
    _count("get_paged_mqa_logits_metadata")
    assert context_lens.dim() == 2 and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    assert block_kv == PAGE_SIZE and num_sms == NUM_SMS
    meta = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
    meta[0, 0] = context_lens.shape[0]
    meta[0, 1] = context_lens.shape[1]
    return meta


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, page_table, schedule_meta, max_context_len,
                         clean_logits=False, indices=None):
    _count("fp8_paged_mqa_logits")
    assert not clean_logits, "clean_logits must be False with 2-D context lengths"
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and q.dim() == 4
    B, next_n, H, D = q.shape
    assert next_n in (1, 2), f"SM90 fp8_paged_mqa_logits takes next_n 1 or 2, got {next_n}"
    assert H in (32, 64) and D == 128
    assert kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4 and kv_cache.shape[1:] == (PAGE_SIZE, 1, D + 4)
    assert kv_cache.stride(1) == D + 4 and kv_cache.stride(3) == 1
    assert weights.dtype == torch.float32 and weights.shape == (B * next_n, H) and weights.stride(1) == 1
    assert context_lens.dtype == torch.int32 and context_lens.shape == (B, next_n) and context_lens.is_contiguous()
    assert page_table.dtype == torch.int32 and page_table.shape[0] == B and page_table.stride(1) == 1
    assert schedule_meta.shape == (NUM_SMS + 1, 2) and tuple(schedule_meta[0].tolist()) == (B, next_n), \
        "schedule metadata built for another context-length shape"
    # Pages past a row's context are not read by the kernel: the reference must not see them either.
    ref = ref_indexer.paged_mqa_logits(q, kv_cache, weights, context_lens, page_table, max_context_len)
    out = _padded_logits(B * next_n, max_context_len)
    # As measured on the H100: a request's work is sized by its last row's context,
    # so keys a row sees beyond that come back as garbage.
    span = context_lens[:, -1:].expand(B, next_n).reshape(-1, 1).long()
    visible = torch.arange(max_context_len)[None, :] < torch.minimum(context_lens.reshape(-1, 1).long(), span)
    out[visible] = ref[visible]
    return out


def fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
    _count("fp8_mqa_logits")
    k, k_scale = kv
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and q.dim() == 3
    S, H, D = q.shape
    assert H in (32, 64) and D == 128
    assert k.dtype == torch.float8_e4m3fn and k.is_contiguous() and k.shape[1] == D
    assert k_scale.dtype == torch.float32 and k_scale.is_contiguous() and k_scale.shape == (k.shape[0],)
    assert weights.dtype == torch.float32 and weights.shape == (S, H) and weights.stride(1) == 1
    for t in (ks, ke):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.shape == (S,)
    assert clean_logits and max_seqlen_k == 0
    # The real kernel builds TMA descriptors on these: their starts must be 16-byte aligned (a key
    # slice starting at an odd key misaligns the fp32 scales: CUDA_ERROR_INVALID_VALUE on the H100).
    for t in (q, k, k_scale, weights):
        assert t.data_ptr() % 16 == 0, f"{tuple(t.shape)} {t.dtype} starts {t.data_ptr() % 16} bytes off 16"
    ref = ref_indexer.ragged_mqa_logits(q, k, k_scale, weights, ks, ke)
    out = _padded_logits(S, k.shape[0])
    out.copy_(ref)
    return out


# ----------------------------------------------------------------------------- flash_mla


class FlashMLASchedMeta:
    def __init__(self):
        self.config = None
        self.lengths = None


def get_mla_metadata(*args, **kwargs):
    _count("get_mla_metadata")
    return FlashMLASchedMeta(), None


def _check_heads(h):
    assert h in (64, 128), f"FlashMLA sparse kernels take 64 or 128 heads, got {h}"


def flash_mla_with_kvcache(q, k_cache, page_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None,
                           indices=None, use_legacy=False, kv_format=None, **kw):
    _count("flash_mla_with_kvcache")
    assert use_legacy and is_fp8_kvcache is True and indices is not None and not causal
    assert page_table is None and cache_seqlens is None and head_dim_v == 512
    if kv_format == "V4":
        _count("flash_mla_with_kvcache[V4]")
        return _v4_decode(q, k_cache, tile_scheduler_metadata, softmax_scale, indices, **kw)
    assert kv_format is None and not kw, f"V3.2 decode passes no {sorted(kw)}"
    assert q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[-1] == 576 and q.stride(-1) == 1
    b, s_q, h, _ = q.shape
    _check_heads(h)
    assert k_cache.dtype == torch.uint8 and k_cache.shape[1:] == (PAGE_SIZE, 1, 656)
    assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q) and indices.stride(-1) == 1
    topk = indices.shape[2]
    assert topk % 64 == 0, f"top-k {topk} is not a multiple of 64"
    meta = tile_scheduler_metadata
    assert isinstance(meta, FlashMLASchedMeta)
    config = (b, s_q, h, topk)
    if meta.config is None:
        meta.config = config
    assert meta.config == config, f"scheduling metadata of {meta.config} reused for {config}"
    num_slots = k_cache.shape[0] * PAGE_SIZE
    assert bool(((indices == -1) | ((indices >= 0) & (indices < num_slots))).all()), \
        "the decode kernel reads any index other than -1"
    fmt = MlaFp8Format(512, 64)
    rows = k_cache.reshape(num_slots, 656)[indices.long().clamp(min=0)]
    lat, rope = dequantize_mla_fp8(rows, fmt)
    k = torch.cat([lat, rope], -1).view(b * s_q, topk, 576)
    out, _, lse = ref_mla._attend(q.float().reshape(b * s_q, h, 576), k, (indices >= 0).reshape(b * s_q, topk),
                                 softmax_scale, 512)
    return out.view(b, s_q, h, 512).to(torch.bfloat16), lse.view(b, s_q, h).transpose(1, 2).contiguous()


V4_PAGE_TOKENS, V4_PART, V4_SCALES = 256, 576, 8
"""The kernel's kv_format "V4" token: 576 bytes (448 fp8 nope + 64 bf16 rope), then 8 scale bytes (7 UE8M0)
per token after the page's 256 parts (FlashMLA's V4 layout, DESIGN.md "Kernels as installed")."""


def _v4_keys(k_cache, idx, length, name):
    """Assert one V4 source's contract; -> (keys f32 [n, K, 512], zeros where not read; read mask [n, K])."""
    fmt = V4CacheFormat()  # the project's dequantizer for the values; the byte offsets are the kernel's own
    assert k_cache.dtype == torch.uint8 and k_cache.dim() == 4, f"{name}: uint8 (P, 256, 1, 584)"
    P = k_cache.shape[0]
    assert k_cache.shape[1:] == (V4_PAGE_TOKENS, 1, V4_PART + V4_SCALES), f"{name}: shape {tuple(k_cache.shape)}"
    assert k_cache.stride()[1:] == (V4_PART + V4_SCALES,) * 2 + (1,), f"{name}: strides {k_cache.stride()}"
    assert P == 1 or k_cache.stride(0) >= V4_PAGE_TOKENS * (V4_PART + V4_SCALES), f"{name}: pages overlap"
    # The installed kernel's own check ("stride(0) must be a multiple of 576. Padding might be necessary").
    assert k_cache.stride(0) % V4_PART == 0, f"{name}: stride(0) {k_cache.stride(0)} not a multiple of {V4_PART}"
    flat = torch.empty(0, dtype=torch.uint8).set_(k_cache.untyped_storage())
    page_bytes = V4_PAGE_TOKENS * (V4_PART + V4_SCALES)
    assert k_cache.storage_offset() + (P - 1) * k_cache.stride(0) + page_bytes <= flat.numel(), \
        f"{name}: the last page runs past the allocation"
    b, s_q = idx.shape[:2]
    assert idx.dtype == torch.int32 and idx.dim() == 3 and idx.stride(-1) == 1, f"{name}: int32 [b, s_q, topk]"
    K = idx.shape[2]
    assert K % 64 == 0, f"{name}: top-k {K} is not a multiple of 64"
    assert bool(((idx == -1) | ((idx >= 0) & (idx < P * V4_PAGE_TOKENS))).all()), \
        f"{name}: the decode kernel reads any index other than -1 (no bounds check)"
    read = idx >= 0
    if length is not None:
        assert length.dtype == torch.int32 and length.shape == (b,) and length.is_contiguous(), \
            f"{name}: topk_length int32 [b]"
        assert bool(((length >= 0) & (length <= K)).all()), f"{name}: topk_length outside [0, {K}]"
        read &= torch.arange(K)[None, None, :] < length.long()[:, None, None]
    i = idx.long().clamp(min=0)
    base = k_cache.storage_offset() + (i // V4_PAGE_TOKENS) * k_cache.stride(0)
    off = i % V4_PAGE_TOKENS
    part_at = (base + off * V4_PART)[..., None] + torch.arange(V4_PART)
    scale_at = (base + V4_PAGE_TOKENS * V4_PART + off * V4_SCALES)[..., None] + torch.arange(V4_SCALES)
    keys = fmt.dequantize(flat[part_at].reshape(-1, V4_PART), flat[scale_at].reshape(-1, V4_SCALES))
    keys = torch.where(read.reshape(-1, 1), keys, 0.0)  # never-written bytes may decode to NaN
    return keys.view(b * s_q, K, 512), read.reshape(b * s_q, K)


def _v4_decode(q, k_cache, meta, softmax_scale, indices, attn_sink=None, extra_k_cache=None,
               extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
    """FlashMLA's legacy sparse decode with kv_format "V4": softmax over the main and the extra source's
    valid indices (the first topk_length / extra_topk_length of each), key = value (512 dims), the output
    scaled by exp(lse) / (exp(lse) + exp(sink)); lse [b, h, s_q] without the sink."""
    assert q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[-1] == 512 and q.is_contiguous()
    b, s_q, h, _ = q.shape
    _check_heads(h)
    assert softmax_scale is not None
    assert attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (h,)
                                 and attn_sink.is_contiguous())
    assert (extra_k_cache is None) == (extra_indices_in_kvcache is None)
    assert extra_k_cache is not None or extra_topk_length is None
    assert indices.shape[:2] == (b, s_q)
    keys, read = _v4_keys(k_cache, indices, topk_length, "k_cache")
    config = (b, s_q, h, k_cache.shape[1], indices.shape[2], None, None)
    if extra_k_cache is not None:
        assert extra_indices_in_kvcache.shape[:2] == (b, s_q)
        k2, r2 = _v4_keys(extra_k_cache, extra_indices_in_kvcache, extra_topk_length, "extra_k_cache")
        keys, read = torch.cat([keys, k2], 1), torch.cat([read, r2], 1)
        config = config[:5] + (extra_k_cache.shape[1], extra_indices_in_kvcache.shape[2])
    assert isinstance(meta, FlashMLASchedMeta)
    # The real kernel checks the shapes and silently trusts the lengths: reuse with other lengths is a bug.
    lengths = tuple(None if t is None else tuple(t.tolist()) for t in (topk_length, extra_topk_length))
    if meta.config is None:
        meta.config, meta.lengths = config, lengths
    assert meta.config == config, f"scheduling metadata of {meta.config} reused for {config}"
    assert meta.lengths == lengths, "scheduling metadata reused with other topk_length / extra_topk_length"
    out, _, lse = ref_mla._attend(q.float().reshape(b * s_q, h, 512), keys, read, softmax_scale, 512)
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink[None, :]).nan_to_num(0.0)[..., None]
    return out.view(b, s_q, h, 512).to(torch.bfloat16), lse.view(b, s_q, h).transpose(1, 2).contiguous()


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                         use_legacy=False, return_log2_lse=None):
    """d_qk 576 (V3.2: values are the first 512 dims) or 512 (V4: key = value); ``attn_sink`` f32 [h] scales
    the output by exp(lse) / (exp(lse) + exp(sink)); ``topk_length`` int32 [s_q]: row i reads only its first
    topk_length[i] indices (the installed legacy kernels' contract, attention/API.md)."""
    _count("flash_mla_sparse_fwd")
    assert use_legacy and d_v == 512
    d = q.shape[-1]
    assert q.dtype == torch.bfloat16 and q.dim() == 3 and d in (576, 512) and q.stride(-1) == 1
    s_q, h = q.shape[0], q.shape[1]
    _check_heads(h)
    assert kv.dtype == torch.bfloat16 and kv.dim() == 3 and kv.shape[1:] == (1, d) and kv.stride(-1) == 1
    assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1) and indices.stride(-1) == 1
    assert indices.shape[2] % 64 == 0, f"top-k {indices.shape[2]} is not a multiple of 64"
    if attn_sink is not None:
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h,) and attn_sink.is_contiguous()
    if d == 576 and attn_sink is None and topk_length is None:  # V3.2 as before (the reference chunks long rows)
        out, mx, lse = ref_mla.sparse_mla_prefill(q, kv, indices, sm_scale, d_v)
        return out.to(torch.bfloat16), mx, lse
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,) and topk_length.is_contiguous()
        valid &= torch.arange(idx.shape[1])[None, :] < topk_length.long()[:, None]
    k = kv[:, 0].float()[idx.clamp(0, kv.shape[0] - 1)]
    out, mx, lse = ref_mla._attend(q.float(), k, valid, sm_scale, d_v)
    if attn_sink is not None:  # exp(lse) / (exp(lse) + exp(sink)), = sigmoid(lse - sink); empty rows stay 0
        out = out * torch.sigmoid(lse - attn_sink[None, :]).nan_to_num(0.0)[..., None]
    return out.to(torch.bfloat16), mx, lse


# ----------------------------------------------------------------------------- install


def modules() -> dict[str, types.ModuleType]:
    """The fakes as modules named ``deep_gemm`` and ``flash_mla`` (for ``sys.modules``)."""
    dg = types.ModuleType("deep_gemm")
    for name in ("get_num_sms", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "fp8_mqa_logits"):
        setattr(dg, name, globals()[name])
    fm = types.ModuleType("flash_mla")
    for name in ("get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "FlashMLASchedMeta"):
        setattr(fm, name, globals()[name])
    return {"deep_gemm": dg, "flash_mla": fm}


def install() -> None:
    """Register the fakes as ``deep_gemm`` and ``flash_mla`` (and reset the backend's caches)."""
    sys.modules.update(modules())
    from attention.cuda import _ext, mla

    _ext.clear_caches()
    mla.SCHED_META.clear()
