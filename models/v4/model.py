"""The DeepSeek-V4 causal LM on the reference backend, with its MTP layer.

Module names are the checkpoint's own (DeepSeek's release naming, which
transformers' ``save_pretrained`` also writes): ``embed``, ``layers.N.attn.*``,
``layers.N.ffn.*``, ``layers.N.attn_norm`` / ``ffn_norm``, ``layers.N.hc_attn`` /
``hc_ffn`` (checkpoint ``hc_attn_fn`` etc.), ``hc_head``, ``norm``, ``head``,
``mtp.D.*`` (``models.v4.mtp``); ``models.v4.loader`` maps the few names that differ.

The residual is ``hc_mult`` streams ``[T, hc, D]``: each block collapses them
(hyper-connection ``pre`` weights), and writes back ``post * out + comb^T streams``;
``hc_head`` collapses them once more before the final norm. ``forward`` returns the
streams after the last block, flat ``[T, hc * D]``, not the collapsed hidden state:
they are what the MTP layer reads (``models.v4.mtp``), and ``logits`` collapses the rows
it is given (``hc_head``, ``norm``, ``head``). The engine carries that one tensor as
"the hidden state" of a position, for sampling and for the next draft alike.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from attention.v4_format import V4CacheFormat
from attention.v4_index_format import V4IndexFormat
from models.parallel import ReplicatedLinear
from models.v4.batch import V4Batch, sequence_positions
from models.v4.block import V4Block
from models.v4.config import V4Config
from models.v4.layers import HyperHead, V4RMSNorm, V4Rotary
from models.v4.mtp import V4MTPLayer, paged_mtp_forward
from models.v4.state import SequenceState

__all__ = ["DeepseekV4ForCausalLM", "V4Block"]


class DeepseekV4ForCausalLM(nn.Module):
    """Forward over the new tokens of several sequences, each with its ``SequenceState``.

    with_mtp: build the checkpoint's ``num_nextn_predict_layers`` MTP layers (``mtp``; the engine
    drafts with them, `mtp_forward`); False: none (the engine asks ``len(model.mtp)``)."""

    def __init__(self, cfg: V4Config, dtype: torch.dtype = torch.float32, with_mtp: bool = True):
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
        # (attend, new_meta) of a paged decode kernel (`set_decode_kernel`), None: every forward as the reference.
        self.decode_kernel = None
        n_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList([V4MTPLayer(cfg, d, dtype) for d in range(n_mtp)])

    @property
    def num_cache_layers(self) -> int:
        """Attention layers that own cache pages: the main layers plus the MTP layers."""
        return self.cfg.num_hidden_layers + len(self.mtp)

    def set_kv_cache_format(self, fmt: V4CacheFormat | None, index_fmt: V4IndexFormat | None = None) -> None:
        """Compute with the cache formats ``fmt`` and ``index_fmt`` (``models.v4.cache_spec.v4_formats``):
        every sliding-window key and compressed entry is rounded through ``fmt``, every CSA indexer key
        through ``index_fmt`` (``v4_format.round_trip_v4``), when made, as paged caches of those formats
        store them. None: unquantized (the default)."""
        for block in [*self.layers, *self.mtp]:
            block.attn.kv_format = fmt
            if block.attn.compressor is not None:
                block.attn.compressor.kv_format = fmt
            if block.attn.indexer is not None:
                block.attn.indexer.compressor.kv_format = index_fmt

    def set_decode_kernel(self, attend, new_meta) -> None:
        """DECODE forwards given their pages (``forward``'s ``paged``) attend through ``attend`` reading them
        in place (``attention.cuda.v4_decode.v4_sparse_decode``, its scheduling metadata from ``new_meta``);
        the runner builds the ``models.v4.paged_decode.PagedDecode`` (`decode_kernel`), and the MTP layer's
        chained draft steps (DECODE batches, ``models.v4.mtp.paged_mtp_forward``) too."""
        self.decode_kernel = (attend, new_meta)

    def set_attention_kernel(self, attend) -> None:
        """Run every block's sparse attention through ``attend`` (the signature of
        ``attention.v4_attention.sparse_attention_with_sink``; the cuda backend's is
        ``attention.cuda.v4_attention.sparse_attention_with_sink``)."""
        for block in [*self.layers, *self.mtp]:
            block.attn.attend = attend

    def new_state(self, device=None) -> SequenceState:
        """An empty sequence (no tokens forwarded yet)."""
        device = device if device is not None else self.embed.weight.device
        return SequenceState(layers=[layer.attn.new_state(device) for layer in self.layers])

    def new_mtp_state(self, depth: int = 0, device=None) -> SequenceState:
        """MTP layer ``depth``'s empty state (one layer: its sliding-window keys), for `mtp_step`."""
        device = device if device is not None else self.embed.weight.device
        return SequenceState(layers=[self.mtp[depth].attn.new_state(device)])

    def forward(self, input_ids: torch.Tensor, q_lens: list[int], states: list[SequenceState],
                paged=None) -> torch.Tensor:
        """input_ids int64 ``[T]``: the next ``q_lens[r]`` tokens of sequence ``r``
        (in order, ``sum(q_lens) = T``), continuing ``states[r]`` (updated in place)
        -> the residual streams after the last block, flat ``[T, hc * hidden]`` in the
        model dtype (`logits` turns rows of it into logits). ``paged``: a
        ``models.v4.paged_decode.PagedDecode`` (a DECODE forward attending over its pages in place)."""
        if len(q_lens) != len(states) or sum(q_lens) != input_ids.shape[0]:
            raise ValueError(f"q_lens {q_lens} must give one length per state ({len(states)}) "
                             f"summing to the {input_ids.shape[0]} tokens")
        ranges, positions = sequence_positions(q_lens, [st.seq_len for st in states], input_ids.device)
        x = self.embed(input_ids)
        rope = {label: rot(positions, x.dtype) for label, rot in self.rotary.items()}
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            h = layer(h, input_ids, positions, rope, ranges, [st.layers[i] for st in states], self.rotary["compress"],
                      paged)
        for n, st in zip(q_lens, states):
            st.seq_len += n
        return h.flatten(1)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Streams ``[n, hc * hidden]`` (`forward`'s rows) -> the final normed hidden ``[n, hidden]``
        (``hc_head`` then ``norm``)."""
        return self.norm(self.hc_head(hidden.reshape(hidden.shape[0], self.cfg.hc_mult, -1)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Streams ``[n, hc * hidden]`` (`forward`'s rows) -> fp32 logits ``[n, vocab]``."""
        return self.head(self.final_hidden(hidden)).float()

    def mtp_logits(self, streams: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP layer ``depth``'s output streams ``[n, hc * hidden]`` -> fp32 draft logits ``[n, vocab]``
        (its own ``hc_head`` and ``norm``, then the shared ``head``)."""
        return self.head(self.mtp[depth].collapse(streams)).float()

    def mtp_forward(self, batch: V4Batch, prev_hidden: torch.Tensor, cache, backend=None, depth: int = 0,
                    reuse=None, draft: bool = True, rows: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor | None, torch.Tensor, None]:
        """One MTP step over ``batch`` (``DsaForCausalLM.mtp_forward``'s contract, so the engine drafts with
        either): ``batch.input_ids`` are the tokens *after* each position, ``prev_hidden`` ``[T, hc * hidden]``
        the main model's streams (or the previous draft step's output) at the same positions; the MTP
        layer's keys come from and go to the batch's ``swa`` pages in ``cache`` (a ``GroupedPagedCache``).
        Returns (fp32 draft logits ``[T, vocab]``, None without ``draft``; output streams
        ``[T, hc * hidden]`` for a chained step; None: the layer selects no top-k). ``rows``: int64
        ``[n]``, the only rows wanted of both. ``backend``: unused (reference computation);
        ``reuse``: must be None (no indexer in the MTP block: nothing to reuse)."""
        if reuse is not None:
            raise ValueError("DeepSeek-V4's MTP layer attends over its sliding window only: no top-k to reuse")
        logits, x = paged_mtp_forward(self, batch, prev_hidden, cache, depth, draft, rows)
        return logits, x, None
