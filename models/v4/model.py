"""The DeepSeek-V4 causal LM on the reference backend.

Module names are the checkpoint's own (DeepSeek's release naming, which
transformers' ``save_pretrained`` also writes): ``embed``, ``layers.N.attn.*``,
``layers.N.ffn.*``, ``layers.N.attn_norm`` / ``ffn_norm``, ``layers.N.hc_attn`` /
``hc_ffn`` (checkpoint ``hc_attn_fn`` etc.), ``hc_head``, ``norm``, ``head``;
``models.v4.loader`` maps the few names that differ.

The residual is ``hc_mult`` streams ``[T, hc, D]``: each block collapses them
(hyper-connection ``pre`` weights), and writes back ``post * out + comb^T streams``;
``hc_head`` collapses them once more before the final norm.

The MTP (next-n) layer of the checkpoint is not built yet (transformers does
not instantiate it either, so there is no reference to test it against).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from attention.v4_format import V4CacheFormat
from models.parallel import ReplicatedLinear
from models.v4.attention import V4Attention
from models.v4.config import V4Config
from models.v4.layers import HyperConnection, HyperHead, V4RMSNorm, V4Rotary, expand
from models.v4.moe import V4MoE
from models.v4.state import SequenceState


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

    def forward(self, h, input_ids, positions, rope, ranges, states, compress_rotary) -> torch.Tensor:
        """h ``[T, hc, D]`` -> ``[T, hc, D]``."""
        post, comb, x = self.hc_attn(h)
        cos, sin = rope[self.attn.rope_label]
        out = self.attn(self.attn_norm(x), positions, cos, sin, ranges, states, compress_rotary)
        h = expand(post, comb, out, h)
        post, comb, x = self.hc_ffn(h)
        return expand(post, comb, self.ffn(self.ffn_norm(x), input_ids), h)


class DeepseekV4ForCausalLM(nn.Module):
    """Forward over the new tokens of several sequences, each with its ``SequenceState``."""

    def __init__(self, cfg: V4Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList([V4Block(cfg, i, dtype) for i in range(cfg.num_hidden_layers)])
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = ReplicatedLinear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.rotary = nn.ModuleDict({label: V4Rotary(cfg.hf_config, label, cfg.qk_rope_head_dim)
                                     for label in ("main", "compress")})
        # The MTP layers the engine would draft with: none built yet (the engine asks ``len(model.mtp)``).
        self.mtp = nn.ModuleList()

    def set_kv_cache_format(self, fmt: V4CacheFormat | None) -> None:
        """Compute with the cache format ``fmt`` (``models.v4.cache_spec.v4_kv_format``): every
        sliding-window key and compressed entry is rounded through it (``v4_format.round_trip_v4``)
        when made, as a paged cache of that format stores it. None: unquantized (the default)."""
        for block in self.layers:
            block.attn.kv_format = fmt
            if block.attn.compressor is not None:
                block.attn.compressor.kv_format = fmt

    def new_state(self, device=None) -> SequenceState:
        """An empty sequence (no tokens forwarded yet)."""
        device = device if device is not None else self.embed.weight.device
        return SequenceState(layers=[layer.attn.new_state(device) for layer in self.layers])

    def forward(self, input_ids: torch.Tensor, q_lens: list[int], states: list[SequenceState]) -> torch.Tensor:
        """input_ids int64 ``[T]``: the next ``q_lens[r]`` tokens of sequence ``r``
        (in order, ``sum(q_lens) = T``), continuing ``states[r]`` (updated in place)
        -> final normed hidden states ``[T, hidden]``."""
        if len(q_lens) != len(states) or sum(q_lens) != input_ids.shape[0]:
            raise ValueError(f"q_lens {q_lens} must give one length per state ({len(states)}) "
                             f"summing to the {input_ids.shape[0]} tokens")
        device = input_ids.device
        ranges, pos = [], []
        start = 0
        for n, st in zip(q_lens, states):
            ranges.append((start, start + n))
            pos.append(torch.arange(st.seq_len, st.seq_len + n, device=device))
            start += n
        positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long, device=device)
        x = self.embed(input_ids)
        rope = {label: rot(positions, x.dtype) for label, rot in self.rotary.items()}
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            h = layer(h, input_ids, positions, rope, ranges, [st.layers[i] for st in states], self.rotary["compress"])
        for n, st in zip(q_lens, states):
            st.seq_len += n
        return self.norm(self.hc_head(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[n, hidden]`` -> fp32 logits ``[n, vocab]``."""
        return self.head(hidden).float()
