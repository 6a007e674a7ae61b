"""The lightning indexer of DeepSeek Sparse Attention.

Per query token it scores every visible cached token,
``score[t] = sum_h w_h * relu(q_h . k_t)`` (with ``w_h`` carrying
``n_heads^-0.5 * head_dim^-0.5``), and keeps the top ``index_topk`` tokens. The
selected cache slots drive sparse MLA in the same layer (and, for GLM-5's
shared layers, in the following layers too).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.batch import ForwardBatch, ForwardMode
from models.config import ModelConfig
from models.norms import LayerNorm
from models.ops import cuda_ops
from models.parallel import ReplicatedLinear
from models.rope import apply_rope, fused_rope


def hadamard_matrix(dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix ``[dim, dim]`` (``dim`` a power of two)."""
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dim, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim**0.5).to(dtype=dtype, device=device)


class SelectedTokens:
    """Top-k selection of one computing layer, reused by the layers that share it.

    slots:     int64 ``[T, topk]`` cache slots, ``-1`` = none (decode path input)
    positions: int64 ``[T, topk]`` token positions within the request, ``-1`` = none
    packed:    a PREFILL forward's selection as the sparse prefill call takes it: per packed context
               (`ForwardBatch.packed_contexts`, in order) int32 ``[t, topk]`` packed indices, ``-1`` = none
               (``positions + row_start``); None: derive them from ``positions`` (a row subset, decode)
    """

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, packed: list[torch.Tensor] | None = None):
        self.slots, self.positions, self.packed = slots, positions, packed


class Indexer(nn.Module):
    """Weights: ``wq_b [H*D, q_lora]``, ``wk [D, hidden]``, ``k_norm`` (LayerNorm),
    ``weights_proj [H, hidden]`` (kept in fp32, like the reference)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, hadamard: bool):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        self.rope_interleaved = cfg.indexer_rope_interleave
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype)
        self.wk = ReplicatedLinear(cfg.hidden_size, self.head_dim, dtype=dtype)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, dtype=torch.float32)
        self.hadamard = hadamard
        if hadamard:
            self.register_buffer("rotation", torch.empty(self.head_dim, self.head_dim), persistent=False)
            self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.hadamard:
            self.rotation = hadamard_matrix(self.head_dim, device=self.rotation.device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[T, (H,) head_dim]`` -> rope'd, float32 (what the scoring and the cache writes take)."""
        # The indexer's rope dims come first (MLA puts them last).
        ops = fused_rope(x, cos, self.rope_dim)
        if ops is not None:  # one kernel: rotate, copy the rest, store fp32
            return ops.apply_rope(x, cos, sin, self.rope_interleaved, rotate=self.rope_dim, out_dtype=torch.float32)
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        return torch.cat([apply_rope(rot, cos, sin, self.rope_interleaved), rest], dim=-1).float()

    def write_keys(self, x, cos, sin, batch: ForwardBatch, cache, layer: int, backend,
                   k_proj: torch.Tensor | None = None) -> None:
        """Compute and cache this step's indexer keys only (a step that reuses an
        earlier top-k still leaves its keys for later queries). ``k_proj``: ``wk(x)``
        ``[T, head_dim]`` when computed already (`models.fused_projections`)."""
        k = self._rope(self.k_norm(self.wk(x) if k_proj is None else k_proj), cos, sin)
        if self.hadamard:
            # Orthonormal: q.k is unchanged, but outliers spread out before fp8.
            k = k @ self.rotation
        backend.write_index(cache, layer, batch.out_slots, k)

    def forward(self, x, q_resid, cos, sin, batch: ForwardBatch, cache, layer: int, backend,
                k_proj: torch.Tensor | None = None, q_proj: torch.Tensor | None = None) -> SelectedTokens:
        """x: ``[T, hidden]``, q_resid: ``[T, q_lora]``; writes this step's keys to
        ``cache`` layer ``layer`` and returns the top-k selection of every token. ``k_proj`` /
        ``q_proj``: ``wk(x)`` / ``wq_b(q_resid)`` when computed already (`models.fused_projections`)."""
        T = x.shape[0]
        self.write_keys(x, cos, sin, batch, cache, layer, backend, k_proj)
        if batch.mode is not ForwardMode.DECODE and all(c.max_window <= self.topk for c in batch.packed_contexts()):
            # Every token's causal window holds at most top-k keys, so the selection is the whole
            # window whatever the scores (both backends' top-k keep every candidate of such a row):
            # no query, logits or top-k to compute. Prompts up to index_topk tokens (2048 in
            # DeepSeek-V3.2) take this path in every layer.
            return self._whole_windows(batch)
        q = self._rope((self.wq_b(q_resid) if q_proj is None else q_proj).view(T, self.n_heads, self.head_dim), cos, sin)
        raw = self.weights_proj(x.float())
        factor = self.n_heads**-0.5 * self.head_dim**-0.5
        if self.hadamard:
            q = q @ self.rotation
        ops = cuda_ops("index_query_cuda") if q.is_cuda and cache.spec.kv_cache_dtype == "fp8" else None
        if ops is not None and ops.supports(q):
            q, weights = ops.quantize_query(q, raw, factor)  # one kernel; the torch below is its spec
        elif cache.spec.kv_cache_dtype == "fp8":
            q, q_scale = quantize_query_fp8(q)
            weights = raw * factor * q_scale  # relu(s * x) = s * relu(x) for s > 0
        else:
            weights = raw * factor
        if batch.mode is ForwardMode.DECODE:
            return self._select_decode(q, weights, batch, cache, layer, backend)
        return self._select_extend(q, weights, batch, cache, layer, backend)

    def _select_decode(self, q, weights, batch, cache, layer, backend) -> SelectedTokens:
        n = batch.decode_width()
        B = batch.num_requests
        # Derived from the batch alone: built once per forward, not in every indexer layer.
        ctx = batch.layer_invariant("index_context_lens", lambda: (batch.positions + 1).view(B, n).to(torch.int32))
        rows_tables = batch.layer_invariant("index_row_tables", lambda: batch.page_tables.repeat_interleave(n, 0))
        logits = backend.paged_mqa_logits(
            q.view(B, n, self.n_heads, self.head_dim), cache.index[layer], weights,
            ctx, batch.page_tables, batch.seq_len_bound(),
        )
        positions, slots = backend.topk_slots(logits, ctx.view(-1), self.topk, rows_tables)
        return SelectedTokens(slots.long(), positions.long())

    def _whole_windows(self, batch: ForwardBatch) -> SelectedTokens:
        # The same for every layer of the forward (it depends on the batch alone): built once.
        return batch.layer_invariant(("whole_windows", self.topk), lambda: _joined(
            [ctx.whole_windows(self.topk) for ctx in batch.packed_contexts()], batch))

    def _select_extend(self, q, weights, batch, cache, layer, backend) -> SelectedTokens:
        # The keys of a group of requests in one gather and one logits + top-k call over their packed
        # rows (each row sees its own request's window): the cuda backend scores row chunks sized by
        # a memory budget and never holds the [rows, context] matrix (a 128k-token prompt's would not fit).
        groups = []
        for ctx in batch.packed_contexts():
            keys = cache.read_index(layer, ctx.slots, checked=False)
            t = ctx.tokens
            packed, _ = backend.ragged_topk(q[t], keys, None, weights[t], ctx.row_start, ctx.row_end, self.topk,
                                            None, windows_host=(ctx.row_start_host, ctx.row_end_host))
            groups.append(packed)
        return _joined(groups, batch)


def _joined(packed: list[torch.Tensor], batch: ForwardBatch) -> SelectedTokens:
    """A PREFILL forward's selection from each packed context's packed indices ``[t, k]`` (in order): the
    slots and request-local positions in token order, the packed indices kept for the attention call."""
    packed = [p.to(torch.int32) for p in packed]
    groups = [ctx.local(p) for ctx, p in zip(batch.packed_contexts(), packed)]
    if len(groups) == 1:
        return SelectedTokens(*groups[0], packed=packed)
    return SelectedTokens(torch.cat([s for s, _ in groups]), torch.cat([p for _, p in groups]), packed=packed)


def quantize_query_fp8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) fp8 quantisation of indexer queries.

    q: fp32 ``[T, H, D]`` -> (float8_e4m3fn ``[T, H, D]``, fp32 scale ``[T, H]``).
    """
    amax = q.abs().amax(-1).clamp_min(1e-10)
    scale = amax / 448.0
    return (q / scale[..., None]).to(torch.float8_e4m3fn), scale
