"""The ``cuda`` attention backend: the reference's functions on FlashMLA, DeepGEMM and Triton.

=====================  =========================================================
``paged_mqa_logits``   DeepGEMM ``fp8_paged_mqa_logits`` (+ Triton tail mask)
``ragged_mqa_logits``  DeepGEMM ``fp8_mqa_logits`` in row chunks
``topk_slots``         the Triton radix top-k (``attention.cuda.topk``; long rows: sampled threshold + compaction)
``sparse_mla_decode``  FlashMLA ``flash_mla_with_kvcache`` on the fp8 pool
``sparse_mla_prefill`` FlashMLA ``flash_mla_sparse_fwd``
``write_mla``          Triton fp8 MLA cache write (byte-identical to ``PagedKVCache.write_mla``)
``write_index``        Triton fp8 indexer cache write
``ragged_topk``        chunked ragged logits + top-k without the full ``[S, N]`` logits
=====================  =========================================================

Requirements (checked, with errors naming the dims): ``kv_cache_dtype="fp8"``,
kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128, index_n_heads 32
or 64; see :func:`check_cache_spec`.

Differences from the reference, all documented in ``attention/API.md``:
outputs of attention are bf16; top-k lists a row's selection in ascending
position order; a top-k position whose page is missing yields slot -1 instead
of an IndexError; out-of-range decode indices are treated as invalid.
"""

from __future__ import annotations

import torch

from .. import formats
from ..cache import PagedKVCache
from ..formats import PAGE_SIZE, IndexerFp8Format, MlaFp8Format
from . import logits as _logits
from . import mla as _mla
from .cache_write import write_indexer_fp8, write_mla_fp8
from .topk import SAMPLED_MIN_LEN, topk_positions
from .topk import topk_slots as _topk_slots_kernel


def check_cache_spec(spec) -> None:
    """Raise ``ValueError`` unless a :class:`~attention.cache.CacheSpec` can run on the cuda backend."""
    if not spec.is_fp8:
        raise ValueError(
            "the cuda attention backend needs the fp8 cache (kv_cache_dtype='fp8'): FlashMLA's sparse "
            f"decode and DeepGEMM's paged logits read the fp8 byte formats; got {spec.kv_cache_dtype!r}"
        )
    _mla.check_mla_dims(spec.kv_lora_rank, spec.rope_dim)
    if spec.index_head_dim != _logits.SUPPORTED_INDEX_HEAD_DIM:
        raise ValueError(
            f"the cuda attention backend needs index_head_dim = {_logits.SUPPORTED_INDEX_HEAD_DIM}, "
            f"got {spec.index_head_dim}"
        )


def topk_slots(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    page_table_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.indexer.topk_slots`` on the Triton radix top-k.

    Rows of ``>= topk.SAMPLED_MIN_LEN`` logits take the sampled kernels (a
    threshold from a sample of the row, one compaction pass, the exact select
    over the candidates), shorter ones the fused one-program-per-row kernel
    configured by :func:`topk_launch_config`; both select the same, bit for bit.

    Returns ``(positions int32 [R, topk], slots int32 [R, topk])``: the same
    selection as the reference (lowest positions win exact ties), listed in
    ascending position order, ``-1`` padded.
    """
    if logits.dim() != 2:
        raise ValueError(f"expected logits [R, L], got {tuple(logits.shape)}")
    logits = logits if logits.dtype == torch.float32 else logits.float()
    lengths = torch.as_tensor(lengths, device=logits.device).reshape(-1).to(torch.int32).contiguous()
    cfg = topk_launch_config(logits.shape[1])
    if page_table_rows is None:
        positions = topk_positions(logits, lengths, topk, **cfg)
        return positions, positions.clone()
    bt = torch.as_tensor(page_table_rows, device=logits.device).to(torch.int32)
    return _topk_slots_kernel(logits, lengths, topk, bt, return_positions=True, **cfg)


def topk_launch_config(row_len: int) -> dict:
    """Block and warps of the fused (one program per row) top-k for rows of ``row_len`` logits.

    Rows of ``>= topk.SAMPLED_MIN_LEN`` logits take the sampled kernels instead
    (``topk_slots(method="auto")``), which ignore these.

    Long rows take 4096/16, the fastest of an H100 sweep (docs/perf.md, "Tuning
    choices and their measurements"); short rows (prefill chunks, tiny models) keep 1024/8.
    """
    return {"block": 4096, "num_warps": 16} if row_len >= 16384 else {"block": 1024, "num_warps": 8}


def decode_logits_widths(max_context: int) -> tuple[int, ...]:
    """The indexer-logits widths a captured decode step of contexts up to ``max_context`` gets graphs for:
    below `topk.SAMPLED_MIN_LEN` the fused top-k, from it the sampled kernels (four launches a layer, which
    cost a short context ~17 us a layer more than the fused one: H200, docs/perf.md session 26). So a config
    serving long contexts also has graphs whose logits are one page narrower than that, for the steps whose
    every context fits them (`workers.decode_graphs.DecodeGraphPlan.logits_pages`)."""
    short = SAMPLED_MIN_LEN - PAGE_SIZE
    return (short, max_context) if max_context > short else (max_context,)


def _on_cuda(t: torch.Tensor) -> bool:
    # Triton runs CPU tensors only in interpreter mode (tests); the cache's own
    # torch path serves CPU otherwise.
    import os

    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def write_mla(cache: PagedKVCache, layer: int, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
    """``cache.write_mla`` through the Triton fp8 kernel (same bytes); other caches use the cache's own write."""
    spec = cache.spec
    if not (spec.is_fp8 and _on_cuda(cache.mla[layer])):
        cache.write_mla(layer, slots, latent, rope)
        return
    n = slots.numel()
    if latent.shape != (n, spec.kv_lora_rank) or rope.shape != (n, spec.rope_dim):
        raise ValueError(f"expected latent [{n}, {spec.kv_lora_rank}] and rope [{n}, {spec.rope_dim}], "
                         f"got {tuple(latent.shape)} and {tuple(rope.shape)}")
    write_mla_fp8(cache.mla[layer], slots.reshape(-1), latent, rope,
                  MlaFp8Format(spec.kv_lora_rank, spec.rope_dim))


def write_index(cache: PagedKVCache, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
    """``cache.write_index`` through the Triton fp8 kernel (same bytes); other caches use the cache's own write."""
    spec = cache.spec
    pool = cache._index_layer(layer)
    if not (spec.is_fp8 and _on_cuda(pool)):
        cache.write_index(layer, slots, k)
        return
    if k.shape != (slots.numel(), spec.index_head_dim):
        raise ValueError(f"expected k [{slots.numel()}, {spec.index_head_dim}], got {tuple(k.shape)}")
    write_indexer_fp8(pool, slots.reshape(-1), k, IndexerFp8Format(spec.index_head_dim))


def make_backend(name: str = "cuda"):
    """Build the cuda :class:`~attention.backend.AttentionBackend` (no kernel package is imported here)."""
    from ..backend import AttentionBackend

    return AttentionBackend(
        name=name,
        paged_mqa_logits=_logits.paged_mqa_logits,
        ragged_mqa_logits=_logits.ragged_mqa_logits,
        topk_slots=topk_slots,
        sparse_mla_decode=_mla.sparse_mla_decode,
        sparse_mla_prefill=_mla.sparse_mla_prefill,
        quantize_mla_fp8=formats.quantize_mla_fp8,
        dequantize_mla_fp8=formats.dequantize_mla_fp8,
        quantize_indexer_fp8=formats.quantize_indexer_fp8,
        dequantize_indexer_fp8=formats.dequantize_indexer_fp8,
        write_mla=write_mla,
        write_index=write_index,
        ragged_topk=_logits.ragged_topk,
        check_cache_spec=check_cache_spec,
        decode_logits_widths=decode_logits_widths,
    )
