"""The DSA causal LM (DeepSeek-V3.2 / GLM-5) with its MTP (next-n) layer.

Module names follow the Hugging Face checkpoint names, so the loader maps
tensors one to one (``model.layers.N.self_attn.indexer.wq_b.weight``, ...).
The MTP layer is checkpoint layer ``num_hidden_layers`` and is held as
``mtp[0]``; its attention uses cache layer ``num_hidden_layers``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.batch import ForwardBatch
from models.config import ModelConfig
from models.decoder import DecoderLayer
from models.indexer import SelectedTokens
from models.norms import RMSNorm
from models.parallel import SINGLE, ReplicatedLinear, TPContext
from models.rope import RotaryEmbedding


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.head = ReplicatedLinear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)


class MTPLayer(nn.Module):
    """DeepSeek-V3 multi-token prediction block.

    Input for a token at position ``i``: the embedding of token ``i + 1`` and the
    target model's final (normed) hidden state at ``i``;
    ``h = eh_proj([enorm(emb); hnorm(hidden)])`` then one decoder layer, and
    ``shared_head`` turns it into logits for token ``i + 2``.
    """

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, hadamard: bool):
        super().__init__()
        self.embed_tokens = _embedding(cfg, dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, dtype=dtype)
        self.decoder = DecoderLayer(cfg, tp, dtype, dense=False, owns_indexer=True, hadamard=hadamard)
        self.shared_head = SharedHead(cfg, dtype)


def _embedding(cfg: ModelConfig, dtype: torch.dtype) -> nn.Embedding:
    """The token embedding, uninitialised like every other weight (the loader fills it): nn.Embedding's
    own random init on the meta device imports torch's reference decompositions, 4-8 s of the first
    meta build in a process (`dsa-pd check`, `models.footprint`)."""
    return nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                        _freeze=True)


class DsaForCausalLM(nn.Module):
    """Forward over a ``ForwardBatch``: returns the final normed hidden states
    ``[T, hidden]``; ``logits()`` maps chosen rows to fp32 ``[n, vocab]``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPContext = SINGLE,
                 hadamard: bool = False, with_mtp: bool = True):
        super().__init__()
        self.cfg, self.dtype, self.tp = cfg, dtype, tp
        plan = cfg.topk_plan
        self.embed_tokens = _embedding(cfg, dtype)
        self.layers = nn.ModuleList([
            DecoderLayer(cfg, tp, dtype, dense=cfg.mlp_layer_types[i] == "dense",
                         owns_indexer=plan.computes[i], hadamard=hadamard)
            for i in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = ReplicatedLinear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.qk_rope_head_dim)
        n_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList([MTPLayer(cfg, tp, dtype, hadamard) for _ in range(n_mtp)])
        self.two_batch = None
        """A `models.two_batch.TwoBatchOverlap` running each forward as two overlapped micro-batches
        (set by `workers.rank_build.build_rank` when the spec asks for it); None: whole forwards."""

    @property
    def num_cache_layers(self) -> int:
        """Attention layers that own cache pages: decoder layers plus MTP layers."""
        return self.cfg.num_hidden_layers + len(self.mtp)

    def forward(self, batch: ForwardBatch, cache, backend) -> torch.Tensor:
        if self.two_batch is not None:  # tp > 1 with two-batch overlap (`models.two_batch`)
            return self.two_batch(lambda micro: self._forward(micro, cache, backend), batch)
        return self._forward(batch, cache, backend)

    def _forward(self, batch: ForwardBatch, cache, backend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        selected: SelectedTokens | None = None
        for i, layer in enumerate(self.layers):
            x, selected = layer(x, cos, sin, batch, cache, i, backend, selected)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[n, hidden]`` -> fp32 logits ``[n, vocab]``."""
        return self.lm_head(hidden).float()

    def mtp_forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, cache, backend, depth: int = 0,
                    reuse: SelectedTokens | None = None, draft: bool = True, rows: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor | None, torch.Tensor, SelectedTokens]:
        """One MTP step over ``batch``, whose ``input_ids`` are the tokens *after*
        each position (shifted by one) and ``prev_hidden`` ``[T, hidden]`` the
        target's (or the previous draft step's) hidden states at the same
        positions. Returns (fp32 draft logits ``[T, vocab]``, MTP hidden
        ``[T, hidden]`` for chained drafts, the top-k selection used).

        ``draft=False``: only the MTP layer's cache pages are wanted (a prompt's
        prefill): no head, and None for the logits. Over an 8k-token chunk of
        DeepSeek-V3.2 the head is 15 TFLOP and a [8192, 129280] fp32 tensor
        (4.2 GB) that prefill would throw away.

        ``rows``: int64 ``[n]`` on the batch's device, the only rows wanted: the three
        outputs are those rows (``[n, vocab]``, ``[n, hidden]``, selection ``[n, topk]``),
        and the head runs on them alone (a fixed-width draft forward wants one row of each
        request's ``k + 1``: `workers.mtp_draft`). Every row still writes its cache entry."""
        mtp = self.mtp[depth]
        emb = mtp.embed_tokens(batch.input_ids)
        x = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(prev_hidden.to(emb.dtype))], dim=-1))
        cos, sin = self.rotary(batch.positions, x.dtype)
        x, selected = mtp.decoder(x, cos, sin, batch, cache, self.cfg.num_hidden_layers + depth, backend, None, reuse)
        if rows is not None:
            x = x.index_select(0, rows)
            selected = SelectedTokens(selected.slots.index_select(0, rows), selected.positions.index_select(0, rows))
        logits = mtp.shared_head.head(mtp.shared_head.norm(x)).float() if draft else None
        return logits, x, selected
