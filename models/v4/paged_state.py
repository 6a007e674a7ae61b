"""A sequence's DeepSeek-V4 state in the paged cache groups, and back.

The model (``models.v4.model``) forwards over ``SequenceState`` s. Between
forwards the engine keeps nothing per sequence but its pages: before a forward
`load_state` rebuilds the state of ``seq_len`` tokens from the sequence's pages
of each group (``attention.group_cache.GroupedPagedCache``), after it
`store_state` writes back what the forward added. What each group's positions
mean (groups declared by ``models.v4.cache_spec.v4_cache_groups``):

* ``swa``: position ``t`` = token ``t``'s key. Every key is written; only the
  last ``window - 1`` are read. Every page of the sequence is kept (so a cached
  prefix holds the window before each of its cuts: ``workers.v4_prefix``);
* ``csa_kv`` / ``hca_kv`` / ``csa_index``: position ``e`` = compressed entry ``e``;
* ``csa_state`` / ``hca_state`` / ``csa_index_state``: one page per sequence,
  slot rows ``[wkv | wgate]`` fp32 (``2 * w`` values, ``w`` the compressor's
  projection width): with overlapping windows (CSA) slots ``[0, m)`` hold the
  first half of the last complete window (gate with its position bias, as the
  compressor keeps it; ``w / 2`` used) and slots ``[m, 2m)`` the projections
  after the last complete window (the partially filled block); without (HCA)
  slots ``[0, m)`` the latter. How many are valid follows from ``seq_len``:
  ``seq_len % m`` pending rows, the overlap once ``seq_len >= m``.

So the state moves between replicas with the pages (PD), and a sequence
continued from pages computes exactly what the standalone model computes.

Cut states (prefix caching, ``workers.v4_prefix``): a state page as `store_state`
leaves it for a sequence of exactly ``c`` tokens, ``c`` a multiple of every
compress ratio, so that a sequence sharing the first ``c`` tokens continues from
it. At such a ``c`` no compressor has a pending row and only the overlapping
(CSA) ones hold anything, the overlap. `record_fed` makes a forward record the
raw projections those compressors are fed, `store_cut_states` writes the state
at each cut the forward crossed into the page given for it.
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
    dev = cache.device
    layers = []
    for i, block in enumerate(model.layers):
        attn = block.attn
        dtype = attn.wkv.weight.dtype
        k = min(attn.window - 1, seq_len)
        st = LayerState(swa=cache.read("swa", i, pages["swa"], _arange(seq_len - k, seq_len, dev)).to(dtype))
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
    dev = cache.device
    n = state.seq_len
    for i, (block, st) in enumerate(zip(model.layers, state.layers)):
        attn = block.attn
        first = n - st.swa.shape[0]  # st.swa holds positions [first, n)
        new = max(old_len, first)
        if new < n:
            cache.write("swa", i, pages["swa"], _arange(new, n, dev), st.swa[new - first:])
        if attn.kind != SLIDING:
            s = _short(attn.kind)
            _store_compressor(cache, attn.compressor, f"{s}_kv", f"{s}_state", i, pages, st.comp, old_len)
            if attn.indexer is not None:
                _store_compressor(cache, attn.indexer.compressor, "csa_index", "csa_index_state", i, pages, st.index,
                                  old_len)


def record_fed(model, state: SequenceState) -> None:
    """Make the next forward of ``state`` (just loaded) record the raw projections its overlapping (CSA)
    compressors are fed (``CompressorState.fed_kv`` / ``fed_gate``), starting with their pending rows:
    the positions from the last block boundary ``seq_len - seq_len % m`` on (`store_cut_states` reads them)."""
    for block, st in zip(model.layers, state.layers):
        for _, _, cs in _overlap_compressors(block.attn, st):
            cs.fed_kv, cs.fed_gate = cs.pending_kv, cs.pending_gate


def store_cut_states(model, cache: GroupedPagedCache, state: SequenceState, old_len: int,
                     cut_pages: Mapping[int, Mapping[str, int]]) -> None:
    """After a forward of ``state`` from ``old_len`` tokens (`record_fed` before it): write the state at
    each cut ``c`` of ``cut_pages`` (``old_len < c <= state.seq_len``, a multiple of every compress ratio)
    into ``cut_pages[c][group]`` of each overlapping compressor's state group (``csa_state``,
    ``csa_index_state``), as `store_state` writes the state of a ``c``-token sequence: the overlap, the
    first half of block ``[c - m, c)``'s raw projections (gate plus position bias, as the compressor keeps
    it), and no pending row. The other state groups need no page: at ``c`` their state is empty."""
    dev = cache.device
    for i, (block, st) in enumerate(zip(model.layers, state.layers)):
        for comp, group, cs in _overlap_compressors(block.attn, st):
            m, d = comp.ratio, comp.dim
            base = old_len - old_len % m  # position of fed row 0
            n_slots = cache.layouts[group].group.tokens_per_page
            for c, pages in cut_pages.items():
                if c % m or not old_len < c <= state.seq_len:
                    raise ValueError(f"cut {c} is not a block boundary crossed by a forward of "
                                     f"({old_len}, {state.seq_len}] tokens (ratio {m})")
                kv, gate = cs.fed_kv[c - m - base:c - base], cs.fed_gate[c - m - base:c - base]
                rows = _state_rows(comp, n_slots, kv[:0], gate[:0], kv[:, :d], gate[:, :d] + comp.ape[:, :d], dev)
                cache.write(group, i, [pages[group]], _arange(0, n_slots, dev), rows)


def _overlap_compressors(attn, st: LayerState):
    """``(compressor, state group, its CompressorState)`` of each overlapping compressor of a layer."""
    if attn.kind == SLIDING:
        return []
    out = []
    if attn.compressor.overlap:
        out.append((attn.compressor, f"{_short(attn.kind)}_state", st.comp))
    if attn.indexer is not None and attn.indexer.compressor.overlap:
        out.append((attn.indexer.compressor, "csa_index_state", st.index))
    return out


def _load_compressor(cache, comp: Compressor, kv_group: str, state_group: str, layer: int, pages: PageMap,
                     seq_len: int) -> CompressorState:
    dev, m, w = cache.device, comp.ratio, comp.wkv.out_features
    dtype = comp.wkv.weight.dtype
    entries = cache.read(kv_group, layer, pages[kv_group], _arange(0, seq_len // m, dev)).to(dtype)
    slots = cache.read(state_group, layer, pages[state_group], _arange(0, cache.layouts[state_group].group.tokens_per_page, dev))
    kv, gate = slots[:, :w], slots[:, w:]
    base, j = (m if comp.overlap else 0), seq_len % m
    st = CompressorState(entries, kv[base:base + j].to(dtype), gate[base:base + j].to(dtype))
    if comp.overlap and seq_len >= m:
        d = comp.dim
        # The compressor keeps this gate as (projection + position bias): the promoted dtype.
        st.overlap_kv = kv[:m, :d].to(dtype)
        st.overlap_gate = gate[:m, :d].to(torch.promote_types(dtype, comp.ape.dtype))
    return st


def _store_compressor(cache, comp: Compressor, kv_group: str, state_group: str, layer: int, pages: PageMap,
                      st: CompressorState, old_len: int) -> None:
    dev, m = cache.device, comp.ratio
    old = old_len // m
    if st.num_entries > old:
        cache.write(kv_group, layer, pages[kv_group], _arange(old, st.num_entries, dev), st.entries[old:])
    n_slots = cache.layouts[state_group].group.tokens_per_page
    rows = _state_rows(comp, n_slots, st.pending_kv, st.pending_gate, st.overlap_kv, st.overlap_gate, dev)
    cache.write(state_group, layer, pages[state_group], _arange(0, n_slots, dev), rows)


def _state_rows(comp: Compressor, n_slots: int, pending_kv, pending_gate, overlap_kv, overlap_gate,
                device) -> torch.Tensor:
    """A state page's slot rows fp32 ``[n_slots, 2 w]`` (module docstring)."""
    m, w = comp.ratio, comp.wkv.out_features
    rows = torch.zeros(n_slots, 2 * w, dtype=torch.float32, device=device)
    base, j = (m if comp.overlap else 0), pending_kv.shape[0]
    rows[base:base + j, :w], rows[base:base + j, w:] = pending_kv, pending_gate
    if overlap_kv is not None:
        d = comp.dim
        rows[:m, :d], rows[:m, w:w + d] = overlap_kv, overlap_gate
    return rows
