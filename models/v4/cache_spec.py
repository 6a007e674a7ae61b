"""The cache groups a DeepSeek-V4 config needs (``attention.cache_groups.CacheGroup``).

* ``swa``: every layer's sliding-window keys, 584-byte tokens (``attention.v4_format``), 256 a page;
* ``csa_kv`` / ``hca_kv``: the compressed entries of the CSA (c4) / HCA (c128) layers, same format;
* ``csa_index``: the CSA layers' indexer keys, fp8 + one fp32 scale (``index_head_dim + 4`` bytes);
* ``csa_state`` / ``csa_index_state`` / ``hca_state``: per-sequence compressor state, the raw
  fp32 ``wkv`` and ``wgate`` projections of the last ``2m`` (CSA: overlapping windows) or ``m``
  (HCA) source tokens: the partially filled block at a prompt's end and the block before it.

The MTP layer's caches are not declared yet (the MTP layer is not built).
"""

from __future__ import annotations

from attention.cache_groups import CacheGroup
from attention.formats import IndexerFp8Format
from attention.v4_format import PAGE_TOKENS, V4CacheFormat
from models.v4.config import CSA, HCA, V4Config

_FP32 = 4


def v4_cache_groups(cfg: V4Config) -> tuple[CacheGroup, ...]:
    """The groups of ``cfg``'s main layers, in a fixed order (swa, then per kind kv, index, state)."""
    fmt = V4CacheFormat.for_head(cfg.head_dim, cfg.qk_rope_head_dim)
    n = cfg.num_hidden_layers
    groups = [CacheGroup("swa", "swa", PAGE_TOKENS, fmt.bytes_per_token, fmt.page_bytes, tuple(range(n)),
                         window=cfg.sliding_window)]
    for kind, short in ((CSA, "csa"), (HCA, "hca")):
        layers = tuple(i for i in range(n) if cfg.layer_types[i] == kind)
        if not layers:
            continue
        m = dict(cfg.compress_rates)[kind]
        overlap = kind == CSA
        groups.append(CacheGroup(f"{short}_kv", "compressed", PAGE_TOKENS, fmt.bytes_per_token, fmt.page_bytes,
                                 layers, ratio=m))
        if overlap:
            ix = IndexerFp8Format(cfg.index_head_dim).bytes_per_token
            groups.append(CacheGroup(f"{short}_index", "indexer", PAGE_TOKENS, ix, PAGE_TOKENS * ix, layers, ratio=m))
        slots = 2 * m if overlap else m
        width = (2 if overlap else 1) * cfg.head_dim
        per = 2 * width * _FP32  # kv + gate
        groups.append(CacheGroup(f"{short}_state", "state", slots, per, slots * per, layers, ratio=m))
        if overlap:
            per_ix = 2 * (2 * cfg.index_head_dim) * _FP32
            groups.append(CacheGroup(f"{short}_index_state", "state", slots, per_ix, slots * per_ix, layers, ratio=m))
    return tuple(groups)


def v4_group_layouts(cfg: V4Config, dtype, kv_cache_dtype: str = "auto") -> tuple:
    """How the engine stores each of `v4_cache_groups` (``attention.group_cache.GroupLayout``), same order.

    ``kv_cache_dtype`` ``"auto"``: sliding-window keys, compressed entries and indexer keys unquantized in
    the model ``dtype``, one ``head_dim`` (``index_head_dim``) row per position (exact math: the engine's
    output equals the standalone model's); state slots fp32: the compressor's ``wkv`` then ``wgate`` row,
    ``2 * width`` values (CSA slots ``[0, m)`` the overlap half of the last complete window, ``[m, 2m)``
    the pending projections; HCA slots ``[0, m)`` the pending ones: ``models.v4.paged_state``).
    The fp8 584-byte pages (``attention.v4_format``) are not stored by the engine yet."""
    import torch

    from attention.group_cache import GroupLayout

    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the DeepSeek-V4 engine stores its caches unquantized "
                         f"only ('auto'); its fp8 584-byte pages are not wired into the engine yet")
    out = []
    for g in v4_cache_groups(cfg):
        if g.kind in ("swa", "compressed"):
            out.append(GroupLayout(g, dtype, cfg.head_dim))
        elif g.kind == "indexer":
            out.append(GroupLayout(g, dtype, cfg.index_head_dim))
        else:  # state: bytes_per_token = (kv + gate) x width x fp32
            out.append(GroupLayout(g, torch.float32, g.bytes_per_token // _FP32))
    return tuple(out)
