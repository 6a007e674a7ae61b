"""Mixture of experts: sigmoid scoring with noaux_tc group-limited routing,
routed experts sharded by expert-parallel rank, and shared experts."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import ModelConfig
from models.mlp import MLP
from models.parallel import SINGLE, ReplicatedLinear, TPContext


class Router(nn.Module):
    """noaux_tc routing (DeepSeek-V3): scores = sigmoid(x W^T) in fp32; the
    correction bias only steers *which* experts win, the weights come from the
    unbiased scores. Groups are ranked by the sum of their two best biased scores
    and only the ``topk_group`` best groups compete."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_experts, cfg.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.n_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, hidden]`` -> (weights fp32 ``[T, top_k]``, expert ids int64 ``[T, top_k]``)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        T = x.shape[0]
        grouped = biased.view(T, self.n_group, self.n_experts // self.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
        keep = keep.bool()[:, :, None].expand_as(grouped).reshape(T, self.n_experts)
        ids = biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class Expert(nn.Module):
    """One routed expert (SwiGLU), held whole by the rank that owns it."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = ReplicatedLinear(hidden, intermediate, dtype=dtype)
        self.up_proj = ReplicatedLinear(hidden, intermediate, dtype=dtype)
        self.down_proj = ReplicatedLinear(intermediate, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts are split across ranks by contiguous ranges (expert
    parallel); each rank sums its experts' contributions and one all-reduce
    combines them with the tensor-parallel shared experts."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        per_rank = tp.shard(cfg.n_routed_experts, "n_routed_experts")
        self.first_expert = tp.rank * per_rank
        self.gate = Router(cfg)
        # Keys are global expert ids so checkpoint names map one to one.
        self.experts = nn.ModuleDict({
            str(e): Expert(cfg.hidden_size, cfg.moe_intermediate_size, dtype)
            for e in range(self.first_expert, self.first_expert + per_rank)
        })
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, SINGLE if tp.size == 1 else tp, dtype)
            if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor, static_shapes: bool = False) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``.

        ``static_shapes``: run every local expert over every token, weighted by
        its (possibly zero) routing weight, instead of gathering each expert's
        tokens. No shape depends on the routing, so the step can be captured in
        a CUDA graph; for decode batches (T up to a few hundred) the experts'
        weights are read once either way, so the step stays memory-bound.
        """
        weights, ids = self.gate(x)
        if static_shapes:
            out = self._all_experts(x, weights, ids)
        else:
            out = self._routed_tokens(x, weights, ids)
        if self.tp.size > 1:
            out = self.tp.all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n_local = len(self.experts)
        local = ids - self.first_expert
        mine = (local >= 0) & (local < n_local)
        # [T, n_local] routing weight of each local expert (0 where not chosen).
        dense = torch.zeros(x.shape[0], n_local, dtype=weights.dtype, device=x.device)
        dense.scatter_add_(1, local.clamp(0, n_local - 1), torch.where(mine, weights, 0.0))
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts.values()):
            out += (expert(x) * dense[:, i, None]).to(out.dtype)
        return out

    def _routed_tokens(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for key, expert in self.experts.items():
            token, slot = torch.where(ids == int(key))
            if token.numel() == 0:
                continue
            y = expert(x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out
