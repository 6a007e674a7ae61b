"""DeepSeek-V4 building blocks: norms, partial interleaved RoPE, hyper-connections.

Numerics follow transformers' ``deepseek_v4`` (the executable reference):
norm weights multiply in fp32 before the cast back; hyper-connection mixing
weights are computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class V4RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight, multiplied in fp32, cast once at the end
    (unlike ``models.norms.RMSNorm``, which casts before the multiply)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, the rms in fp32, the product in ``x``'s dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Rotary(nn.Module):
    """cos / sin ``[T, rope_dim / 2]`` of one V4 rope type (``"main"`` for sliding
    layers, ``"compress"`` for CSA / HCA layers, their compressors and indexer).

    Frequencies come from transformers' initialisers (YaRN for "compress" in
    the real models, with ``attention_factor`` 1 as its config forces)."""

    def __init__(self, hf_config, label: str, rope_dim: int):
        super().__init__()
        self.hf_config, self.label, self.rope_dim = hf_config, label, rope_dim
        self.register_buffer("inv_freq", torch.empty(rope_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        params = self.hf_config.rope_parameters[self.label]
        if params.get("rope_type", "default") == "default":
            base = float(params["rope_theta"])
            inv = 1.0 / (base ** (torch.arange(0, self.rope_dim, 2, dtype=torch.float) / self.rope_dim))
            scaling = 1.0
        else:
            inv, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](self.hf_config, None, layer_type=self.label)
        if inv.numel() * 2 != self.rope_dim:
            raise ValueError(f"rope {self.label!r}: init produced {inv.numel() * 2} dims, model needs {self.rope_dim}")
        self.inv_freq = inv.float().to(self.inv_freq.device)
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int ``[T]`` -> (cos, sin) ``[T, rope_dim / 2]`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` ``[T, ..., D]``
    as interleaved pairs ``(x0, x1), (x2, x3), ...``, in place of layout (the
    pairs stay interleaved: V4 reads keys as values, so the layout is visible).

    ``cos`` / ``sin`` ``[T, r/2]`` broadcast over middle dims; the rotation is
    computed in fp32 and cast back to ``x``'s dtype. ``sin`` negated undoes it."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c = cos.repeat_interleave(2, dim=-1).view(shape).float()
    s = sin.repeat_interleave(2, dim=-1).view(shape).float()
    nope, rope = x[..., :-r], x[..., -r:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * c + rot.float() * s).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


def sinkhorn_mix(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float):
    """Hyper-connection weights from the projected streams ``mixes`` fp32 ``[T, (2 + hc) * hc]``.

    Returns (pre ``[T, hc]``, post ``[T, hc]``, comb ``[T, hc, hc]``), fp32; comb is
    projected towards a doubly-stochastic matrix by ``iters`` Sinkhorn steps."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * s_comb + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection: mixing weights from ``hc`` residual
    streams. Parameters ``fn [(2 + hc) * hc, hc * D]``, ``base [(2 + hc) * hc]``,
    ``scale [3]`` (checkpoint ``hc_attn_*`` / ``hc_ffn_*``), all fp32."""

    def __init__(self, hc: int, hidden: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        n = (2 + hc) * hc
        self.fn = nn.Parameter(torch.empty(n, hc * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams ``[T, hc, D]`` -> (post fp32 ``[T, hc]``, comb fp32 ``[T, hc, hc]``,
        collapsed ``[T, D]`` in the streams' dtype)."""
        T = streams.shape[0]
        flat = unweighted_rms_norm(streams.reshape(T, -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre, post, comb = sinkhorn_mix(mixes, self.base, self.scale, self.hc, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """The final collapse of the ``hc`` streams into one hidden state (checkpoint
    ``hc_head_{fn,base,scale}``): sigmoid weights, no Sinkhorn."""

    def __init__(self, hc: int, hidden: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc, hc * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(hc, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams ``[T, hc, D]`` -> ``[T, D]`` in the streams' dtype."""
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """New streams ``[T, hc, D]``: block output ``out`` ``[T, D]`` spread by ``post``
    plus the old streams mixed by ``comb`` transposed (``sum_j comb[j, k] * streams[j]``)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x ``[T, groups * k]``, weight ``[groups * m, k]`` -> ``[T, groups * m]``;
    group ``g`` of ``x`` goes through rows ``[g * m, (g + 1) * m)`` of ``weight``."""
    T = x.shape[0]
    k = weight.shape[1]
    w = weight.view(groups, -1, k)  # [G, m, k]
    y = torch.einsum("tgk,gmk->tgm", x.view(T, groups, k).to(weight.dtype), w)
    return y.reshape(T, -1)
