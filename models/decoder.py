"""One decoder layer: pre-norm MLA (+ indexer) and pre-norm dense MLP or MoE."""

from __future__ import annotations

import torch
import torch.nn as nn

from models.batch import ForwardBatch
from models.config import ModelConfig
from models.indexer import SelectedTokens
from models.mla import MLAttention
from models.mlp import MLP
from models.moe.layer import MoE
from models.norms import RMSNorm
from models.parallel import TPContext


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, dense: bool,
                 owns_indexer: bool, hadamard: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAttention(cfg, tp, dtype, owns_indexer, hadamard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype) if dense else MoE(cfg, tp, dtype)
        self.is_moe = not dense

    def forward(self, x, cos, sin, batch: ForwardBatch, cache, layer: int, backend,
                shared: SelectedTokens | None, reuse: SelectedTokens | None = None) -> tuple[torch.Tensor, SelectedTokens]:
        """x ``[T, hidden]`` -> (``[T, hidden]``, top-k selection of this layer)."""
        h, selected = self.self_attn(self.input_layernorm(x), cos, sin, batch, cache, layer, backend, shared, reuse)
        x, h = self.post_attention_layernorm.add_and_norm(x, h)
        x = x + (self.mlp(h, batch.static_shapes, backend.name) if self.is_moe else self.mlp(h))
        return x, selected
