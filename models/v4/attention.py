"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries.

Per layer (checkpoint names under ``layers.N.attn``):

* queries: ``wq_a`` -> ``q_norm`` -> ``wq_b`` (``[H, D]``), an unweighted RMSNorm per
  head, RoPE on the trailing ``rope`` channels (interleaved);
* the key (= value): ``wkv`` -> ``norm`` -> RoPE; one head shared by all queries;
* ``compressor`` (CSA / HCA layers): ``wkv`` / ``wgate`` / ``ape`` (position bias) /
  ``norm``; every ``m`` tokens become one entry (softmax-gated sum, CSA over
  overlapping windows of ``2m``), rotated with the "compress" RoPE at ``e * m``;
* ``indexer`` (CSA layers): its own compressor at ``index_head_dim`` plus
  ``wq_b`` / ``weights_proj``; picks ``index_topk`` causal entries per query;
* ``attn_sink`` ``[H]``: one extra zero-value logit per head;
* the output's rope channels are rotated back (at the query position), then
  the grouped projection ``wo_a`` (``o_groups`` blocks) and ``wo_b``.

A query at position ``p`` sees window tokens ``(p - window, p]`` and entries
``e < (p + 1) // m`` (an entry is visible once its whole block is in).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from attention.v4_attention import combined_index_row, sparse_attention_with_sink
from attention.v4_format import V4CacheFormat, round_trip_v4
from attention.v4_index_format import V4IndexFormat
from models.parallel import ReplicatedLinear
from models.v4.config import CSA, SLIDING, V4Config
from models.v4.layers import V4RMSNorm, V4Rotary, grouped_linear, rope_tail, unweighted_rms_norm
from models.v4.paged_decode import PagedDecode, causal_entries, paged_decode_attention
from models.v4.state import CompressorState, LayerState


class Compressor(nn.Module):
    """Turns every ``ratio`` tokens into one entry of width ``dim`` (checkpoint
    ``wkv``, ``wgate``, ``ape``, ``norm``). ``overlap`` (CSA): projections are
    ``2 * dim`` wide; entry ``e`` is the gated sum over window ``e - 1``'s first
    half ("Ca") and window ``e``'s second half ("Cb"), ``2 * ratio`` slots."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = ReplicatedLinear(hidden, width, dtype=dtype)
        self.wgate = ReplicatedLinear(hidden, width, dtype=dtype)
        self.ape = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32), requires_grad=False)
        self.norm = V4RMSNorm(dim, eps)
        # The cache format the entries are stored in (fp8 caches: the V4 token for the attention's
        # compressor, fp8 keys for the indexer's; models.v4.cache_spec). None: unquantized.
        self.kv_format: V4CacheFormat | V4IndexFormat | None = None

    def new_state(self, device) -> CompressorState:
        dtype = self.wkv.weight.dtype
        return CompressorState.empty(self.dim, self.wkv.out_features, dtype, device)

    def forward(self, x: torch.Tensor, state: CompressorState, rotary: V4Rotary) -> torch.Tensor:
        """Feed one sequence's new tokens x ``[n, hidden]`` (in order, after
        ``state``'s); appends the entries whose blocks completed to
        ``state.entries`` and returns them ``[k, dim]``."""
        new_kv, new_gate = self.wkv(x), self.wgate(x)
        if state.fed_kv is not None:  # a state from pages: its store writes the raw projections back
            state.fed_kv = torch.cat([state.fed_kv, new_kv])
            state.fed_gate = torch.cat([state.fed_gate, new_gate])
        kv = torch.cat([state.pending_kv, new_kv])
        gate = torch.cat([state.pending_gate, new_gate])
        usable = kv.shape[0] // self.ratio * self.ratio
        state.pending_kv, state.pending_gate = kv[usable:], gate[usable:]
        if usable == 0:
            return state.entries[:0]
        nw, r, d = usable // self.ratio, self.ratio, self.dim
        ckv = kv[:usable].view(nw, r, -1)
        cgate = gate[:usable].view(nw, r, -1) + self.ape
        if self.overlap:
            wkv = ckv.new_zeros(nw, 2 * r, d)
            wgate = cgate.new_full((nw, 2 * r, d), float("-inf"))
            wkv[:, r:], wgate[:, r:] = ckv[..., d:], cgate[..., d:]
            wkv[1:, :r], wgate[1:, :r] = ckv[:-1, :, :d], cgate[:-1, :, :d]
            if state.overlap_kv is not None:  # the block before this call's first one
                wkv[0, :r], wgate[0, :r] = state.overlap_kv, state.overlap_gate
            state.overlap_kv, state.overlap_gate = ckv[-1, :, :d].clone(), cgate[-1, :, :d].clone()
        else:
            wkv, wgate = ckv, cgate
        entries = self.norm((wkv * wgate.softmax(dim=1, dtype=torch.float32).to(wkv.dtype)).sum(dim=1))
        first = state.num_entries
        pos = (torch.arange(nw, device=x.device) + first) * r
        cos, sin = rotary(pos, entries.dtype)
        entries = rope_tail(entries, cos, sin)
        if self.kv_format is not None:  # used from now on as the cache will give them back
            entries = round_trip_v4(entries, self.kv_format)
        state.entries = torch.cat([state.entries, entries])
        return entries


SCORE_BLOCK_BYTES = 1 << 30
"""Most bytes of per-head indexer scores ``[rows, H, N]`` held at once: a chunk of 8k queries over the
8k compressed entries of a 32k prompt would otherwise hold 8k x H x 8k fp32 (64 GiB at 256 heads)."""


def weighted_relu_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 ``[S, N]``: ``sum_h w[s, h] * relu(q[s, h] . keys[n]) * scale`` for q fp32 ``[S, H, d]``,
    keys fp32 ``[N, d]``, w fp32 ``[S, H]``, in blocks of query rows (`SCORE_BLOCK_BYTES`); every row
    is computed by the same ops whatever the block."""
    S, H, _ = q.shape
    N = keys.shape[0]
    out = torch.empty(S, N, dtype=torch.float32, device=q.device)
    rows = max(1, SCORE_BLOCK_BYTES // max(1, H * N * 4))
    for s0 in range(0, S, rows):
        blk = torch.relu(torch.einsum("shd,nd->shn", q[s0:s0 + rows], keys)) * scale
        out[s0:s0 + rows] = (blk * w[s0:s0 + rows, :, None]).sum(dim=1)
    return out


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer over its own compressed keys."""

    def __init__(self, cfg: V4Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.dim, self.topk, self.ratio = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, ratio
        self.compressor = Compressor(cfg.hidden_size, self.dim, ratio, True, cfg.rms_norm_eps, dtype)
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, self.n_heads * self.dim, dtype=dtype)
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, dtype=dtype)

    def forward(self, x, q_res, positions, cos, sin, state: CompressorState, rotary: V4Rotary) -> torch.Tensor:
        """One sequence's new tokens: x ``[S, hidden]``, q_res ``[S, q_lora]``,
        positions int64 ``[S]``, compress-rope cos/sin ``[S, rope/2]`` ->
        int64 ``[S, min(topk, entries)]`` chosen entry ids, ``-1`` where fewer
        causal entries exist. Among equal scores the lower entry wins."""
        self.compressor(x, state, rotary)
        keys = state.entries
        S = x.shape[0]
        q = rope_tail(self.wq_b(q_res).view(S, self.n_heads, self.dim), cos, sin)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        scores = weighted_relu_scores(q.float(), keys.float(), w, self.dim ** -0.5)  # [S, N]
        limit = (positions + 1) // self.ratio  # entries e < limit are complete at the query
        future = torch.arange(keys.shape[0], device=x.device)[None, :] >= limit[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        k = min(self.topk, keys.shape[0])
        ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return torch.where(ids >= limit[:, None], -1, ids)


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.kind, self.layer = cfg.layer_type(layer), layer
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.groups = cfg.o_groups
        self.scale = cfg.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        D, H = cfg.head_dim, cfg.num_attention_heads
        self.wq_a = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype)
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, H * D, dtype=dtype)
        self.wkv = ReplicatedLinear(cfg.hidden_size, D, dtype=dtype)
        self.norm = V4RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = ReplicatedLinear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype=dtype)
        self.wo_b = ReplicatedLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32), requires_grad=False)
        self.ratio = cfg.compress_ratio(layer)
        self.compressor = (Compressor(cfg.hidden_size, D, self.ratio, self.kind == CSA, cfg.rms_norm_eps, dtype)
                           if self.kind != SLIDING else None)
        self.indexer = Indexer(cfg, self.ratio, dtype) if self.kind == CSA else None
        # The sliding-window keys' cache format (None: unquantized); set by the model's set_kv_cache_format.
        self.kv_format: V4CacheFormat | None = None
        # The sparse attention call (the reference's signature); the model's set_attention_kernel swaps it.
        self.attend = sparse_attention_with_sink

    @property
    def rope_label(self) -> str:
        return "main" if self.kind == SLIDING else "compress"

    def new_state(self, device) -> LayerState:
        return LayerState(
            swa=torch.zeros(0, self.head_dim, dtype=self.wkv.weight.dtype, device=device),
            comp=self.compressor.new_state(device) if self.compressor is not None else None,
            index=self.indexer.compressor.new_state(device) if self.indexer is not None else None,
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ranges: list[tuple[int, int]], states: list[LayerState], compress_rotary: V4Rotary,
                paged: PagedDecode | None = None) -> torch.Tensor:
        """x ``[T, hidden]`` (normed), positions int64 ``[T]``, cos/sin ``[T, rope/2]`` of this
        layer's rope, ``ranges[r]`` the token range of sequence ``r`` whose state is
        ``states[r]`` (updated in place) -> ``[T, hidden]``. ``paged``: a DECODE forward whose
        attention reads the pages in place (``models.v4.paged_decode``; the cuda backend's decode)."""
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        q_res = self.q_norm(self.wq_a(x))
        q = rope_tail(unweighted_rms_norm(self.wq_b(q_res).view(T, H, D), self.eps), cos, sin)
        kv = rope_tail(self.norm(self.wkv(x)), cos, sin)
        if self.kv_format is not None:
            # fp8 caches: every key is used as the cache will give it back, in this forward's own
            # attention too, so the output does not depend on where chunks and forwards split a sequence.
            kv = round_trip_v4(kv, self.kv_format)
        if paged is not None:
            out = paged_decode_attention(self, x, q_res, q, kv, positions, cos, sin, ranges, states,
                                         compress_rotary, paged)
        else:
            out = torch.empty(T, H, D, dtype=torch.float32, device=x.device)
            for (s0, s1), st in zip(ranges, states):
                if s1 == s0:  # a sequence with no new tokens this forward
                    continue
                out[s0:s1] = self._sequence(x[s0:s1], q_res[s0:s1], q[s0:s1], kv[s0:s1], positions[s0:s1],
                                            cos[s0:s1], sin[s0:s1], st, compress_rotary)
        o = rope_tail(out.to(x.dtype), cos, -sin).reshape(T, H * D)
        return self.wo_b(grouped_linear(o, self.wo_a.weight, self.groups))

    def window_before(self, st: LayerState) -> torch.Tensor:
        """The keys of the ``window - 1`` positions before a forward's first token (fewer at the start): what
        a new token's window reads besides the forward's own keys; ``st.swa`` becomes them + the new keys."""
        return st.swa[max(0, st.swa.shape[0] - (self.window - 1)):]

    def _sequence(self, x, q_res, q, kv, positions, cos, sin, st: LayerState, compress_rotary) -> torch.Tensor:
        """One sequence's new tokens -> attention output fp32 ``[S, H, D]``; updates ``st``."""
        S = x.shape[0]
        # The window before this forward's first token, then its keys: positions [p0 - len(prev), p1).
        prev = self.window_before(st)
        window_kv = torch.cat([prev, kv])
        first_pos = int(positions[0]) - prev.shape[0]
        # SWA part: positions (p - window, p] as window_kv rows, -1 before position 0.
        offs = torch.arange(self.window - 1, -1, -1, device=x.device)
        swa_pos = positions[:, None] - offs[None, :]
        swa_idx = torch.where(swa_pos >= 0, swa_pos - first_pos, -1)
        if self.compressor is None:
            entries = window_kv[:0]
            comp_idx = torch.zeros(S, 0, dtype=torch.long, device=x.device)
        else:
            self.compressor(x, st.comp, compress_rotary)
            entries = st.comp.entries
            if self.indexer is not None:
                comp_idx = self.indexer(x, q_res, positions, cos, sin, st.index, compress_rotary)
            else:  # HCA: every entry whose block is complete
                comp_idx = causal_entries(positions, self.ratio, entries.shape[0])
        workspace = torch.cat([entries.to(window_kv.dtype), window_kv])
        rows = combined_index_row(comp_idx, swa_idx, 0, entries.shape[0])
        # Every key of this forward stays (not only the last window - 1): the paged store writes them all
        # (`models.v4.paged_state`); the next forward takes the window it reads.
        st.swa = window_kv
        return self.attend(q, workspace, rows, self.attn_sink, self.scale)
