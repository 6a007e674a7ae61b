"""A sequence's DeepSeek-V4 state in the paged cache groups, and back.

The model (``models.v4.model``) forwards over ``SequenceState`` s. Between
forwards the engine keeps nothing per sequence but its pages: before a forward
`load_state` rebuilds the state of ``seq_len`` tokens from the sequence's pages
of each group (``attention.group_cache.GroupedPagedCache``), after it
`store_state` writes back what the forward added. What each group's positions
mean (groups declared by ``models.v4.cache_spec.v4_cache_groups``):

* ``swa``: position ``t`` = token ``t``'s key. Only the last ``window - 1`` tokens'
  keys are read (and written: a chunk's tokens that fall out of the window
  within the chunk are never stored); every page of the sequence is kept,
  so a page older than the window holds stale values nobody reads;
* ``csa_kv`` / ``hca_kv`` / ``csa_index``: position ``e`` = compressed entry ``e``;
* ``csa_state`` / ``hca_state`` / ``csa_index_state``: one page per sequence, a
  ring: source position ``p``'s raw ``[wkv | wgate]`` projections (fp32, ``2 * w``
  values, ``w`` the compressor's projection width) in slot ``p % R``
  (``R = cache_spec.state_slots``). The state of ``seq_len`` tokens reads the
  positions after the last complete block (the partially filled one, ``seq_len % m``
  rows) and, with overlapping windows (CSA), the block before it (its first half is
  the overlap; the gate gets its position bias added on load, as the compressor
  adds it). A store writes the positions its forward fed (the last ``R``), so a
  forward may resume from any length up to ``STATE_LOOKAHEAD`` before where the
  previous one ended: an MTP verify's rejected drafts leave the state of the
  accepted ones readable (a state page holding only the state *after* the
  forward could not be rolled back);
* the MTP layers (``num_hidden_layers + d``): ``swa`` only (`load_mtp_state`,
  `store_mtp_state`).

So the state moves between replicas with the pages (PD), and a sequence
continued from pages computes exactly what the standalone model computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from attention.group_cache import GroupedPagedCache
from models.v4.attention import Compressor
from models.v4.config import CSA, SLIDING
from models.v4.state import CompressorState, LayerState, SequenceState

PageMap = Mapping[str, Sequence[int]]
"""A sequence's pages: group name -> page ids, in position order."""


def _short(kind: str) -> str:
    return "csa" if kind == CSA else "hca"


def _arange(a: int, b: int, device) -> torch.Tensor:
    return torch.arange(a, b, dtype=torch.int64, device=device)


def load_state(model, cache: GroupedPagedCache, pages: PageMap, seq_len: int) -> SequenceState:
    """The ``SequenceState`` of a sequence of ``seq_len`` tokens whose values are in ``pages``."""
    layers = []
    for i, block in enumerate(model.layers):
        attn = block.attn
        st = LayerState(swa=_load_swa(cache, attn, i, pages, seq_len))
        if attn.kind != SLIDING:
            s = _short(attn.kind)
            st.comp = _load_compressor(cache, attn.compressor, f"{s}_kv", f"{s}_state", i, pages, seq_len)
            if attn.indexer is not None:
                st.index = _load_compressor(cache, attn.indexer.compressor, "csa_index", "csa_index_state", i, pages,
                                            seq_len)
        layers.append(st)
    return SequenceState(layers=layers, seq_len=seq_len)


def store_state(model, cache: GroupedPagedCache, pages: PageMap, state: SequenceState, old_len: int) -> None:
    """Write what forwarding ``state`` from ``old_len`` to ``state.seq_len`` tokens added into ``pages``."""
    for i, (block, st) in enumerate(zip(model.layers, state.layers)):
        attn = block.attn
        _store_swa(cache, i, pages, st, old_len, state.seq_len)
        if attn.kind != SLIDING:
            s = _short(attn.kind)
            _store_compressor(cache, attn.compressor, f"{s}_kv", f"{s}_state", i, pages, st.comp, old_len)
            if attn.indexer is not None:
                _store_compressor(cache, attn.indexer.compressor, "csa_index", "csa_index_state", i, pages, st.index,
                                  old_len)


def load_mtp_state(model, cache: GroupedPagedCache, pages: PageMap, seq_len: int, depth: int = 0) -> SequenceState:
    """MTP layer ``depth``'s state (one `LayerState`: its sliding-window keys) after its entries of positions
    ``0 .. seq_len - 1``, from the ``swa`` pages of cache layer ``num_hidden_layers + depth``."""
    layer = model.cfg.num_hidden_layers + depth
    return SequenceState(layers=[LayerState(swa=_load_swa(cache, model.mtp[depth].attn, layer, pages, seq_len))],
                         seq_len=seq_len)


def store_mtp_state(model, cache: GroupedPagedCache, pages: PageMap, state: SequenceState, old_len: int,
                    depth: int = 0) -> None:
    """Write MTP layer ``depth``'s keys of positions ``old_len .. state.seq_len - 1`` (`load_mtp_state`)."""
    _store_swa(cache, model.cfg.num_hidden_layers + depth, pages, state.layers[0], old_len, state.seq_len)


def _load_swa(cache, attn, layer: int, pages: PageMap, seq_len: int) -> torch.Tensor:
    """The last ``window - 1`` keys before ``seq_len`` of cache layer ``layer`` ``[k, head_dim]``."""
    k = min(attn.window - 1, seq_len)
    return cache.read("swa", layer, pages["swa"], _arange(seq_len - k, seq_len, cache.device)).to(attn.wkv.weight.dtype)


def _store_swa(cache, layer: int, pages: PageMap, st: LayerState, old_len: int, n: int) -> None:
    """The keys ``st.swa`` holds of positions ``old_len .. n - 1`` (the older ones of a long forward fell out
    of the window within it: nobody reads them)."""
    first = n - st.swa.shape[0]  # st.swa holds positions [first, n)
    new = max(old_len, first)
    if new < n:
        cache.write("swa", layer, pages["swa"], _arange(new, n, cache.device), st.swa[new - first:])


def _load_compressor(cache, comp: Compressor, kv_group: str, state_group: str, layer: int, pages: PageMap,
                     seq_len: int) -> CompressorState:
    dev, m, w = cache.device, comp.ratio, comp.wkv.out_features
    dtype = comp.wkv.weight.dtype
    ring = cache.layouts[state_group].group.tokens_per_page
    entries = cache.read(kv_group, layer, pages[kv_group], _arange(0, seq_len // m, dev)).to(dtype)
    pending_from = seq_len - seq_len % m
    overlap = comp.overlap and seq_len >= m
    first = pending_from - m if overlap else pending_from
    rows = cache.read(state_group, layer, pages[state_group], _arange(first, seq_len, dev) % ring)
    kv, gate = rows[:, :w].to(dtype), rows[:, w:].to(dtype)
    o = pending_from - first
    st = CompressorState(entries, kv[o:], gate[o:], fed_kv=kv[:0], fed_gate=gate[:0])
    if overlap:
        d = comp.dim
        # As the compressor keeps them: the first half of the last complete block, the gate with its
        # position bias added (in the promoted dtype, as `Compressor.forward` adds it).
        st.overlap_kv = kv[:m, :d]
        st.overlap_gate = gate[:m, :d] + comp.ape[:, :d]
    return st


def _store_compressor(cache, comp: Compressor, kv_group: str, state_group: str, layer: int, pages: PageMap,
                      st: CompressorState, old_len: int) -> None:
    dev, m = cache.device, comp.ratio
    old = old_len // m
    if st.num_entries > old:
        cache.write(kv_group, layer, pages[kv_group], _arange(old, st.num_entries, dev), st.entries[old:])
    if st.fed_kv is None:
        raise ValueError("a compressor state not loaded from pages (`load_state`) has no record of its raw projections")
    # The raw projections of the positions this forward fed (the last `ring` of them), each in its slot.
    ring = cache.layouts[state_group].group.tokens_per_page
    fed = st.fed_kv.shape[0]
    keep = min(fed, ring)
    if keep:
        rows = torch.cat([st.fed_kv[fed - keep:], st.fed_gate[fed - keep:]], dim=1).float()
        end = old_len + fed
        cache.write(state_group, layer, pages[state_group], _arange(end - keep, end, dev) % ring, rows)
