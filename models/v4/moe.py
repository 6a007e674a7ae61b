"""DeepSeek-V4 MoE: hash-routed or learned top-k routing, clamped SwiGLU experts, one shared expert.

Checkpoint names (relative to ``layers.N.ffn``): ``gate.weight [E, D]``,
``gate.bias [E]`` (learned-routing layers: the selection bias),
``gate.tid2eid [vocab, top_k]`` (hash layers: int expert ids per token id),
``experts.{e}.w1/w3/w2.weight`` (gate / up / down), ``shared_experts.w1/w3/w2``.
The loader renames the routed experts' ``w1 / w3 / w2`` to ``gate_proj / up_proj /
down_proj`` (the stacked ``RoutedExperts`` names).

The reference computes each touched expert over its rows (a plain loop, like
transformers'); a token may pick one expert twice (a hash table may repeat an
id), and then that expert's output counts twice, as in the reference model.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.moe.experts import RoutedExperts
from models.parallel import ReplicatedLinear
from models.v4.config import V4Config


def _score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"scoring_func {func!r} is not supported")


class V4Gate(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool, dtype: torch.dtype):
        super().__init__()
        self.hashed, self.top_k = hashed, cfg.num_experts_per_tok
        self.func, self.scaling = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.int64), requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, D]``, input_ids int64 ``[T]`` -> (weights ``[T, top_k]`` in x's dtype, ids int64 ``[T, top_k]``).

        Weights are the chosen experts' scores normalised to sum 1, times
        ``routed_scaling_factor``; the bias only chooses, never weighs."""
        scores = _score(F.linear(x, self.weight.to(x.dtype)), self.func)
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class V4SharedExpert(nn.Module):
    """``w2(clamped_swiglu(w1 x, w3 x))``, the checkpoint's names."""

    def __init__(self, hidden: int, intermediate: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1 = ReplicatedLinear(hidden, intermediate, dtype=dtype)
        self.w3 = ReplicatedLinear(hidden, intermediate, dtype=dtype)
        self.w2 = ReplicatedLinear(intermediate, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V4MoE(nn.Module):
    """x ``[T, D]`` -> routed experts + shared expert ``[T, D]`` (tensor-parallel size 1)."""

    def __init__(self, cfg: V4Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = V4Gate(cfg, cfg.mlp_layer_type(layer) == "hash_moe", dtype)
        self.experts = RoutedExperts(cfg.hidden_size, cfg.moe_intermediate_size, 0, cfg.n_routed_experts, dtype)
        self.shared_experts = V4SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        w13, w2 = self.experts.w13, self.experts.w2
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), w2[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out + self.shared_experts(x)
