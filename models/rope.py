"""Rotary position embeddings: default and YaRN, two pair layouts.

Frequencies come from transformers' own RoPE initialisers (``ROPE_INIT_FUNCTIONS``)
so YaRN's ramp, ``attention_factor`` and defaults are the library's, not a copy.

Two layouts of the rotated dims exist in these models:

* interleaved pairs ``(x0, x1), (x2, x3), ...`` — MLA's rope part in both
  families and the GLM-5 indexer;
* half-split pairs ``(x_i, x_{i + d/2})`` — the DeepSeek-V3.2 indexer.

The interleaved form returns the rotated pairs de-interleaved (evens then
odds), exactly like transformers' ``apply_rotary_pos_emb_interleave``. That is
a fixed permutation applied to both q and k, so dot products are those of the
true interleaved rotation, and cached keys are bit-compatible with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.ops import cuda_ops


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, shape ``[T, rope_dim / 2]`` each (fp32 math).

    ``hf_config`` is the transformers config (its ``head_dim`` is the rope dim
    after transformers' own post-init, which is what the initialisers read).
    """

    def __init__(self, hf_config, rope_dim: int):
        super().__init__()
        self.hf_config, self.rope_dim = hf_config, rope_dim
        self.register_buffer("inv_freq", torch.empty(rope_dim // 2), persistent=False)
        self.attention_scaling = 1.0
        # On the meta device (models are built there, then loaded) the tables are computed by the
        # loader's reset_buffers(); computing meta tensors here would import torch's reference
        # decompositions (seconds of the first meta build in a process: `dsa-pd check`).
        if self.inv_freq.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        hf_config, rope_dim = self.hf_config, self.rope_dim
        params = hf_config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(params["rope_theta"], rope_dim), 1.0
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        if inv_freq.numel() * 2 != rope_dim:
            raise ValueError(f"RoPE init produced {inv_freq.numel() * 2} dims, model needs {rope_dim}")
        self.inv_freq = inv_freq.float().to(self.inv_freq.device)
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int ``[T]`` -> (cos, sin) each ``[T, rope_dim/2]`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def fused_rope(x: torch.Tensor, cos: torch.Tensor, rotate: int):
    """``models.ops.rope_cuda`` when it takes this CUDA call (one Triton kernel instead of seven), else None."""
    if not x.is_cuda:
        return None
    ops = cuda_ops("rope_cuda")
    return ops if ops is not None and ops.supports(x, cos, rotate) else None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x`` ``[T, ..., d]`` by per-token ``cos``/``sin`` ``[T, d/2]``.

    Middle dims (heads) broadcast. Output has ``x``'s shape and dtype. On CUDA one fused Triton
    kernel (`models.ops.rope_cuda`: the same roundings; this torch code is the spec it is tested against).
    """
    ops = fused_rope(x, cos, x.shape[-1])
    if ops is not None:
        return ops.apply_rope(x, cos, sin, interleaved)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_softmax_scale(rope_parameters: dict, qk_head_dim: int) -> float:
    """Attention softmax scale: ``qk_head_dim ** -0.5`` times YaRN's ``mscale(all_dim)^2``."""
    scale = qk_head_dim**-0.5
    if rope_parameters.get("rope_type", "default") != "default":
        m_all = rope_parameters.get("mscale_all_dim", 0)
        factor = rope_parameters.get("factor", 1.0)
        if m_all and factor > 1:
            mscale = 0.1 * m_all * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale
