"""One DeepSeek-V4 decoder block (``V4Block``): attention and MoE, each behind a hyper-connection.

Module names are the checkpoint's (``layers.N.attn.*``, ``layers.N.ffn.*``, ``attn_norm`` /
``ffn_norm``, ``hc_attn`` / ``hc_ffn``); the MTP layer (``models.v4.mtp``) is a block too.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.v4.attention import V4Attention
from models.v4.config import V4Config
from models.v4.layers import HyperConnection, V4RMSNorm, expand
from models.v4.moe import V4MoE


class V4Block(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, dtype: torch.dtype):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn = V4Attention(cfg, layer, dtype)
        self.ffn = V4MoE(cfg, layer, dtype)
        self.attn_norm = V4RMSNorm(cfg.hidden_size, eps)
        self.ffn_norm = V4RMSNorm(cfg.hidden_size, eps)
        self.hc_attn = HyperConnection(cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.hc_ffn = HyperConnection(cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)

    def forward(self, h, input_ids, positions, rope, ranges, states, compress_rotary, paged=None) -> torch.Tensor:
        """h ``[T, hc, D]`` -> ``[T, hc, D]``; ``paged``: ``V4Attention.forward``'s."""
        post, comb, x = self.hc_attn(h)
        cos, sin = rope[self.attn.rope_label]
        out = self.attn(self.attn_norm(x), positions, cos, sin, ranges, states, compress_rotary, paged)
        h = expand(post, comb, out, h)
        post, comb, x = self.hc_ffn(h)
        return expand(post, comb, self.ffn(self.ffn_norm(x), input_ids), h)
