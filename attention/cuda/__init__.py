"""Triton kernels of the ``cuda`` attention backend.

Byte-for-byte partners of the torch reference in ``attention/formats.py`` and
``attention/indexer.py`` (tested against it in
``tests/attention/test_triton_kernels.py``, on CPU through Triton's
interpreter and compiled on a GPU), and for DeepSeek-V4 in ``attention/v4_format.py``
/ ``v4_index_format.py`` (``tests/attention/test_v4_cache_triton.py``):

=====================================  ==============================================
``write_mla_fp8``                      quantize tokens into the fp8 MLA cache (656 B/token for 512/64)
``write_indexer_fp8``                  quantize indexer keys into 64 x D fp8 + 64 fp32 scale pages
``dequantize_mla_fp8``                 gather slots of the fp8 MLA cache into a bf16 ``[n, r + d]`` workspace
``dequantize_mla_fp8_pages``           the same for whole pages (``page_slots`` gives their slots)
``gather_indexer_fp8``                 copy indexer keys out of their pages: ``(k_fp8 [n, D], scale [n])``
``write_v4_fp8`` / ``read_v4_fp8``     DeepSeek-V4's 584-byte fp8 tokens in their 256-token pages (``v4_cache_ops``)
``write_v4_index_fp8`` (``read_``)     V4's fp8 indexer keys in their pages (``write_pages`` / ``read_pages``: either)
``positions_to_slots``                 top-k positions -> FlashMLA indices ``page * 64 + offset`` / ``-1``
``topk_slots`` / ``topk_positions``    radix top-k over each row's valid length -> slots / positions
                                       (rows of >= ``SAMPLED_MIN_LEN`` logits take the sampled kernels)
``topk_slots_sampled`` (``_positions``)  the same from a sampled threshold and one compaction pass
=====================================  ==============================================

Kernels run on CUDA tensors compiled, or on CPU tensors when ``triton`` was
imported with ``TRITON_INTERPRET=1`` (slow; for tests). All of them address
pools with int64 byte offsets.
"""

from .cache_write import write_indexer_fp8, write_mla_fp8
from .dequant import dequantize_mla_fp8, dequantize_mla_fp8_pages, gather_indexer_fp8, page_slots
from .index_transform import positions_to_slots
from .topk import topk_positions, topk_positions_sampled, topk_slots, topk_slots_sampled
from .v4_cache_ops import read_v4_fp8, read_v4_index_fp8, write_v4_fp8, write_v4_index_fp8

__all__ = [
    "dequantize_mla_fp8",
    "dequantize_mla_fp8_pages",
    "gather_indexer_fp8",
    "page_slots",
    "positions_to_slots",
    "read_v4_fp8",
    "read_v4_index_fp8",
    "topk_positions",
    "topk_positions_sampled",
    "topk_slots",
    "topk_slots_sampled",
    "write_indexer_fp8",
    "write_mla_fp8",
    "write_v4_fp8",
    "write_v4_index_fp8",
]
