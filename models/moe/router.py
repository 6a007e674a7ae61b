"""noaux_tc routing (DeepSeek-V3 / V3.2, GLM-5)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import ModelConfig
from models.ops import cuda_ops


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
        """x ``[T, hidden]`` -> (weights fp32 ``[T, top_k]``, expert ids int64 ``[T, top_k]``).

        A token's ``top_k`` ids are distinct (dispatch relies on it: an expert
        gets at most one row per token)."""
        logits = F.linear(x.float(), self.weight.float())
        ops = cuda_ops("router_cuda") if logits.is_cuda else None
        if ops is not None and ops.supports(self.n_experts, self.n_group, self.topk_group, self.top_k):
            # One kernel after the GEMM (`models.ops.router_cuda`); the torch below is its spec.
            return ops.route(logits, self.e_score_correction_bias.float(), self.n_group, self.topk_group,
                             self.top_k, self.norm_topk_prob, self.scaling)
        scores = logits.sigmoid()
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
