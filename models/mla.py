"""Multi-head latent attention (MLA) in the absorbed form, over sparse top-k tokens.

Cached per token: the normed latent ``c_kv`` (``kv_lora_rank``, 512 in the real
models) and the rotated shared key ``k_pe`` (``qk_rope_head_dim``, 64). Queries
are absorbed into latent space, ``q_lat_h = W_UK_h^T q_nope_h``, so attention
runs with 576-dim keys (latent ++ rope) and 512-dim values (the latent), and
the output is lifted back per head with ``W_UV_h``. This is the form the FlashMLA
kernels compute; it equals the expanded form up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.batch import ForwardBatch, ForwardMode
from models.config import ModelConfig
from models.indexer import Indexer, SelectedTokens
from models.norms import RMSNorm
from models.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, TPContext
from models.rope import apply_rope, mla_softmax_scale


class MLAttention(nn.Module):
    """One attention layer: MLA projections, plus an ``Indexer`` when this layer
    computes its own top-k (``owns_indexer``)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, owns_indexer: bool, hadamard: bool):
        super().__init__()
        self.n_heads = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias, dtype=dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, dtype=dtype)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.qk_head_dim, tp, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.rank + self.rope, bias=cfg.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(self.rank, cfg.num_attention_heads * (self.nope + self.v_dim), tp, dtype=dtype)
        # Read as W_UK / W_UV by the absorbed products (`_absorbed_weights`), not through a GEMM of its own.
        self.kv_b_proj.fp8_ok = False
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.v_dim, cfg.hidden_size, tp, bias=cfg.attention_bias, dtype=dtype)
        self.scale = mla_softmax_scale(cfg.hf_config.rope_parameters, cfg.qk_head_dim)
        self.indexer = Indexer(cfg, dtype, hadamard) if owns_indexer else None
        # Set by `models.fused_projections.fuse_projections` (the cuda backend, after loading): the projections
        # of one input as one GEMM each, replacing q_a / kv_a / the indexer's wk, and q_b / the indexer's wq_b.
        self.x_proj = None
        self.q_proj = None

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK ``[h, nope, rank]``, W_UV ``[h, v, rank]``) views of ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x, cos, sin, batch: ForwardBatch, cache, layer: int, backend,
                shared: SelectedTokens | None, reuse: SelectedTokens | None = None) -> tuple[torch.Tensor, SelectedTokens]:
        """x: ``[T, hidden]`` -> (``[T, hidden]``, the top-k selection used).

        ``shared``: the selection of the previous computing layer, used by a
        layer without an indexer (GLM-5 top-k sharing). ``reuse``: a selection
        an indexer-owning layer takes instead of computing its own (MTP draft
        steps with top-k reuse)."""
        T = x.shape[0]
        index_k = index_q = None  # the indexer's projections, when stacked with these
        if self.x_proj is not None:
            parts = self.x_proj(x)
            q_a, kv = parts[0], parts[-1]
            if len(parts) == 3:
                index_k = parts[1]
        else:
            q_a, kv = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        q_resid = self.q_a_layernorm(q_a)
        if self.q_proj is not None:
            q_b, index_q = self.q_proj(q_resid)
        else:
            q_b = self.q_b_proj(q_resid)
        q = q_b.view(T, self.n_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], apply_rope(q[..., self.nope :], cos, sin, interleaved=True)
        latent = self.kv_a_layernorm(kv[:, : self.rank])
        k_pe = apply_rope(kv[:, None, self.rank :], cos, sin, interleaved=True)[:, 0]
        # Through the backend: the cuda one writes with a Triton kernel that
        # skips slot -1 on the device (no host check: decode steps are graph-captured).
        backend.write_mla(cache, layer, batch.out_slots, latent, k_pe)

        if self.indexer is not None and reuse is not None:
            self.indexer.write_keys(x, cos, sin, batch, cache, layer, backend, k_proj=index_k)
            selected = reuse
        elif self.indexer is not None:
            selected = self.indexer(x, q_resid, cos, sin, batch, cache, layer, backend, k_proj=index_k, q_proj=index_q)
        elif shared is not None:
            selected = shared
        else:  # the config check forbids this; never fall back to a dense or uninitialised path
            raise RuntimeError(f"layer {layer} reuses top-k but no computing layer ran before it")

        w_uk, w_uv = self._absorbed_weights()
        # The absorbed products run in the weights' dtype (fp32 accumulation inside the GEMM):
        # the sparse kernels take a bf16 query anyway, and fp32 copies of W_UK / W_UV cost two
        # weight-sized casts and two fp32 GEMMs per layer per step (H100, 4-layer model: 0.5-0.8
        # ms of a 4-9 ms decode step; docs/perf.md). fp32 models compute in fp32 as before.
        # [T, h, rank + rope]: the absorbed product written straight into its part of the query
        # (per head, [T, nope] @ [nope, rank] into a strided view) instead of concatenated after:
        # a cat copies the whole query, 1.2 GB per layer for an 8192-token chunk (H100 profile).
        q_full = torch.empty(T, self.n_heads, self.rank + self.rope, dtype=w_uk.dtype, device=x.device)
        torch.bmm(q_nope.to(w_uk.dtype).transpose(0, 1), w_uk, out=q_full.transpose(0, 1)[..., : self.rank])
        q_full[..., self.rank:] = q_pe
        if batch.mode is ForwardMode.DECODE:
            n = batch.decode_width()
            B = batch.num_requests
            out, _ = backend.sparse_mla_decode(
                q_full.view(B, n, self.n_heads, -1), cache, layer,
                selected.slots.view(B, n, -1), self.scale, self.rank,
            )
            out = out.reshape(T, self.n_heads, self.rank)
        else:
            out = self._extend_attention(q_full, selected, batch, cache, layer, backend)
        # [T, h, v], written per head through a strided view so the o_proj input needs no copy.
        o = torch.empty(T, self.n_heads, self.v_dim, dtype=w_uv.dtype, device=x.device)
        torch.bmm(out.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
        return self.o_proj(o.view(T, self.n_heads * self.v_dim).to(x.dtype)), selected

    def _extend_attention(self, q_full, selected, batch, cache, layer, backend) -> torch.Tensor:
        # The prefill kernel reads a contiguous kv: gather (and dequantize) the contexts of a group of
        # requests from the paged cache at once, and attend over them in one call with each token's
        # top-k turned into packed indices (a token only ever selects its own request's positions).
        # A token lists at most min(top-k, its window) positions, valid ones first, then -1 (both
        # backends' top-k): columns past the group's widest window hold only -1, and the kernel would
        # still attend over them (a 1024-token prompt with top-k 2048: half the kernel's work).
        outs = []
        for i, ctx in enumerate(batch.packed_contexts()):
            kv = cache.read_mla(layer, ctx.slots, checked=False)
            t = ctx.tokens
            width = max(1, ctx.max_window)
            if selected.packed is not None:  # the indexer's (or a shared layer's) packed indices as they came
                indices = selected.packed[i][:, :width].contiguous()
            else:
                indices = ctx.packed_indices(selected.positions[t][:, :width])
            out, _, _ = backend.sparse_mla_prefill(q_full[t], kv[:, None, :], indices[:, None, :],
                                                   self.scale, self.rank)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs)
