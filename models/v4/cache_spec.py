"""The cache groups a DeepSeek-V4 config needs (``attention.cache_groups.CacheGroup``), and how the
engine stores them (``attention.group_cache.GroupLayout``).

* ``swa``: every layer's sliding-window keys, 256 a page, the MTP layer's included (layer
  ``num_hidden_layers``: its block attends over the window only, so it has no other cache);
* ``csa_kv`` / ``hca_kv``: the compressed entries of the CSA (c4) / HCA (c128) layers, 256 a page;
* ``csa_index``: the CSA layers' indexer keys over their compressed caches, 256 a page;
* ``csa_state`` / ``csa_index_state`` / ``hca_state``: per-sequence compressor state, the raw
  fp32 ``wkv`` and ``wgate`` projections of the last source tokens in a ring of `state_slots`
  slots keyed by position: the partially filled block, the block before it (CSA: overlapping
  windows), and ``STATE_LOOKAHEAD - 1`` more so that a forward that ran past where the next one
  resumes (an MTP verify's rejected drafts) overwrites nothing the next one reads.

What a position holds, by ``kv_cache_dtype`` (`v4_cache_groups` declares these bytes; the storage
allocates exactly them and the transfer pushes them, rounded up to 4 KiB units per group page):

=================  =====================================  ==========================================
group              ``"auto"``                              ``"fp8"`` (the serving format)
=================  =====================================  ==========================================
swa, csa/hca_kv    ``head_dim`` x model dtype              584-byte V4 token (``attention.v4_format``:
                                                           448 fp8 nope + 64 bf16 rope, 7 UE8M0 scales
                                                           padded to 8), V4 pages of 149,760 bytes
csa_index          ``index_head_dim`` x model dtype        fp8 key + fp32 power-of-two scale
                                                           (``attention.v4_index_format``: 132 bytes
                                                           for 128-wide keys, pages of 33,792 bytes)
state groups       fp32 rows                               the same: fp32
=================  =====================================  ==========================================

Kept in fp32 under fp8, by decision: the compressor state (high precision, as in DeepSeek's
release: it is the un-normed, un-gated sum's input, one page per sequence). The indexer's keys are
fp8 in the layout of DeepSeek-V3.2's indexer cache (per-key scale; DeepSeek's V4 release keeps them
in fp8 with a scale layout of its own, not reproduced). With fp8 the model rounds every key,
compressed entry and indexer key through its format the moment it is made
(``DeepseekV4ForCausalLM.set_kv_cache_format``), so what a forward uses equals what pages give back.

With ``with_mtp`` (the checkpoint's MTP layer loaded) the ``swa`` group holds one more layer per
MTP layer, ``num_hidden_layers + d``: its pages are allocated, pushed and freed with the main
layers' (``models.v4.mtp``).
"""

from __future__ import annotations

import torch

from attention.cache_groups import CacheGroup
from attention.v4_format import PAGE_TOKENS, V4CacheFormat
from attention.v4_index_format import V4IndexFormat
from models.v4.config import CSA, HCA, V4Config

_FP32 = 4
KV_CACHE_DTYPES = ("auto", "fp8")

STATE_LOOKAHEAD = 3
"""Positions a forward may write past the length the next forward of its sequence resumes from: an MTP
verify of ``k`` drafts whose drafts are all rejected (the engine drafts at most 3, `SchedulerConfig`)."""


def state_slots(ratio: int, overlap: bool) -> int:
    """Slots of a compressor state page (a ring keyed by position, ``models.v4.paged_state``): the
    ``2m - 1`` (overlapping windows) or ``m - 1`` positions a resuming forward reads, plus the
    `STATE_LOOKAHEAD` positions the forward before it may have written past them."""
    return (2 if overlap else 1) * ratio + STATE_LOOKAHEAD - 1


def v4_kv_format(cfg: V4Config, kv_cache_dtype: str) -> V4CacheFormat | None:
    """The byte format of the sliding-window keys and compressed entries: the V4 fp8 token for
    ``"fp8"``, None (unquantized, model dtype) for ``"auto"``. The one place this is decided."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return V4CacheFormat.for_head(cfg.head_dim, cfg.qk_rope_head_dim) if kv_cache_dtype == "fp8" else None


def v4_index_format(cfg: V4Config, kv_cache_dtype: str) -> V4IndexFormat | None:
    """The byte format of the CSA layers' indexer keys: fp8 keys for ``"fp8"``, None (unquantized, model
    dtype) for ``"auto"``."""
    return V4IndexFormat(cfg.index_head_dim) if v4_kv_format(cfg, kv_cache_dtype) is not None else None


def v4_formats(cfg: V4Config, kv_cache_dtype: str) -> tuple[V4CacheFormat | None, V4IndexFormat | None]:
    """(`v4_kv_format`, `v4_index_format`): what ``DeepseekV4ForCausalLM.set_kv_cache_format`` takes."""
    return v4_kv_format(cfg, kv_cache_dtype), v4_index_format(cfg, kv_cache_dtype)


def v4_cache_groups(cfg: V4Config, kv_cache_dtype: str = "fp8", dtype: torch.dtype = torch.bfloat16,
                    with_mtp: bool = True) -> tuple[CacheGroup, ...]:
    """The groups of ``cfg``'s layers, in a fixed order (swa, then per kind kv, index, state), with
    the bytes the engine stores for ``kv_cache_dtype`` and model ``dtype`` (module docstring; the
    defaults are the serving format). ``with_mtp``: the MTP layers (``cfg.num_nextn_predict_layers``,
    when loaded) get ``swa`` caches too."""
    fmt = v4_kv_format(cfg, kv_cache_dtype)
    item = dtype.itemsize
    if fmt is not None:
        kv_token, kv_page = fmt.bytes_per_token, fmt.page_bytes
    else:
        kv_token = cfg.head_dim * item
        kv_page = PAGE_TOKENS * kv_token
    n = cfg.num_hidden_layers
    swa_layers = cfg.num_layers_with_mtp if with_mtp else n
    groups = [CacheGroup("swa", "swa", PAGE_TOKENS, kv_token, kv_page, tuple(range(swa_layers)),
                         window=cfg.sliding_window)]
    for kind, short in ((CSA, "csa"), (HCA, "hca")):
        layers = tuple(i for i in range(n) if cfg.layer_types[i] == kind)
        if not layers:
            continue
        m = dict(cfg.compress_rates)[kind]
        overlap = kind == CSA
        groups.append(CacheGroup(f"{short}_kv", "compressed", PAGE_TOKENS, kv_token, kv_page, layers, ratio=m))
        if overlap:
            ifmt = v4_index_format(cfg, kv_cache_dtype)
            ix = cfg.index_head_dim * item if ifmt is None else ifmt.bytes_per_token
            ix_page = PAGE_TOKENS * ix if ifmt is None else ifmt.page_bytes
            groups.append(CacheGroup(f"{short}_index", "indexer", PAGE_TOKENS, ix, ix_page, layers, ratio=m))
        slots = state_slots(m, overlap)
        width = (2 if overlap else 1) * cfg.head_dim
        per = 2 * width * _FP32  # kv + gate
        groups.append(CacheGroup(f"{short}_state", "state", slots, per, slots * per, layers, ratio=m))
        if overlap:
            per_ix = 2 * (2 * cfg.index_head_dim) * _FP32
            groups.append(CacheGroup(f"{short}_index_state", "state", slots, per_ix, slots * per_ix, layers, ratio=m))
    return tuple(groups)


def v4_group_layouts(cfg: V4Config, dtype: torch.dtype, kv_cache_dtype: str = "auto", with_mtp: bool = True) -> tuple:
    """How the engine stores each of `v4_cache_groups` (``attention.group_cache.GroupLayout``), same order.

    Sliding-window keys and compressed entries: one ``head_dim`` row per position in the model
    ``dtype`` (``"auto"``: exact math, the engine's output equals the standalone model's), or one
    V4 fp8 token (``"fp8"``: ``GroupLayout.fmt``, quantized on write, dequantized on read). Indexer keys:
    ``index_head_dim`` in ``dtype``, or fp8 keys (``"fp8"``: `v4_index_format`). State slots fp32: the
    compressor's raw ``wkv`` then ``wgate`` projection of one source position, ``2 * width`` values,
    position ``p`` in slot ``p % state_slots`` (``models.v4.paged_state``). ``GroupLayout`` checks each
    group's declared bytes against what it stores."""
    from attention.group_cache import GroupLayout

    fmt, ifmt = v4_formats(cfg, kv_cache_dtype)
    out = []
    for g in v4_cache_groups(cfg, kv_cache_dtype, dtype, with_mtp):
        if g.kind in ("swa", "compressed"):
            out.append(GroupLayout(g, torch.uint8, cfg.head_dim, fmt) if fmt is not None
                       else GroupLayout(g, dtype, cfg.head_dim))
        elif g.kind == "indexer":
            out.append(GroupLayout(g, torch.uint8, cfg.index_head_dim, ifmt) if ifmt is not None
                       else GroupLayout(g, dtype, cfg.index_head_dim))
        else:  # state: bytes_per_token = (kv + gate) x width x fp32
            out.append(GroupLayout(g, torch.float32, g.bytes_per_token // _FP32))
    return tuple(out)


def cut_state_groups(cfg: V4Config) -> tuple[str, ...]:
    """The state groups whose compressors overlap windows (CSA: ``csa_state``, ``csa_index_state``): at a
    block boundary they still hold the overlap, so prefix caching keeps their state at each cut in pages
    of their own (``models.v4.paged_state.store_cut_states``, ``workers.v4_prefix``); the other
    compressors' (HCA) state is empty there."""
    return ("csa_state", "csa_index_state") if CSA in cfg.layer_types[:cfg.num_hidden_layers] else ()
