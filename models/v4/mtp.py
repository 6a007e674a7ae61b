"""The DeepSeek-V4 MTP (multi-token prediction, next-n) layer, and its forward over paged caches.

transformers' ``deepseek_v4`` does not build this layer (it ignores ``mtp.*`` tensors), so there is no
reference to test it against; the structure follows DeepSeek's release as vLLM's ``DeepSeekV4MTP``
reads it. For a token at position ``i``, given the embedding ``e`` of token ``i + 1`` (the main
model's ``embed``) and the main model's hidden state ``h`` at ``i``:

    streams = h_proj(hnorm(h)) + e_proj(enorm(e))         [T, hc, D]
    streams = block(streams)                               one V4 block, compress ratio 0
    logits  = head(norm(hc_head(streams)))                 the main model's ``head``

``h`` is the main model's residual ``hc_mult`` streams after its last block, *before* its
``hc_head`` collapses them (``[T, hc, D]``, carried flat ``[T, hc * D]``): what DeepSeek's release
feeds its MTP block. So ``DeepseekV4ForCausalLM.forward`` returns those streams and its ``logits``
collapses them; the engine carries one tensor for both. ``hnorm`` / ``h_proj`` act on each stream;
``e_proj(enorm(e))`` is added to every stream, as the main model copies the embedding into every
stream before its first block. Two projections, not V3's one ``eh_proj`` over a concatenation.

The block is a ``V4Block`` of layer ``num_hidden_layers + depth``: sliding-window attention only (no
compressor, no indexer: `V4Config.layer_type`), a learned-routing MoE, its own hyper-connections;
its keys live in cache layer ``num_hidden_layers + depth`` of the ``swa`` group. Chained draft steps
feed back the block's output streams (not collapsed) as the next step's ``h``.

Checkpoint names (DeepSeek's release; ``models.v4.loader``): ``mtp.{d}.{enorm,hnorm,norm}.weight``,
``mtp.{d}.{e_proj,h_proj}.weight``, ``mtp.{d}.hc_head_{fn,base,scale}``, and the block's own as a main
layer's: ``mtp.{d}.attn.*``, ``mtp.{d}.ffn.*``, ``mtp.{d}.{attn,ffn}_norm.weight``,
``mtp.{d}.hc_{attn,ffn}_{fn,base,scale}``.

Unlike vLLM, the embedding at position 0 is not zeroed: DeepSeek-V3.2's MTP layer here does not do it
either, and it only changes position 0's entry.
"""

from __future__ import annotations

import torch

from models.batch import ForwardMode
from models.parallel import ReplicatedLinear
from models.v4.batch import V4Batch, sequence_positions
from models.v4.block import V4Block
from models.v4.config import V4Config
from models.v4.layers import HyperHead, V4RMSNorm
from models.v4.paged_decode import PagedDecode
from models.v4.paged_state import load_mtp_state, store_mtp_state
from models.v4.state import SequenceState


class V4MTPLayer(V4Block):
    """MTP layer ``depth``: the block's modules under the checkpoint's own names (``attn``, ``ffn``,
    ``attn_norm``, ``ffn_norm``, ``hc_attn``, ``hc_ffn``) plus ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``,
    ``hc_head``, ``norm``. Norm and hyper-connection weights fp32, projections in ``dtype``."""

    def __init__(self, cfg: V4Config, depth: int, dtype: torch.dtype):
        super().__init__(cfg, cfg.num_hidden_layers + depth, dtype)
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.depth, self.hc = depth, cfg.hc_mult
        self.enorm = V4RMSNorm(D, eps)
        self.hnorm = V4RMSNorm(D, eps)
        self.e_proj = ReplicatedLinear(D, D, dtype=dtype)
        self.h_proj = ReplicatedLinear(D, D, dtype=dtype)
        self.hc_head = HyperHead(cfg.hc_mult, D, cfg.hc_eps, eps)
        self.norm = V4RMSNorm(D, eps)

    def inputs(self, emb: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The block's input streams ``[T, hc, D]`` from the next tokens' embeddings ``emb`` ``[T, D]`` and
        the previous hidden streams ``prev`` ``[T, hc * D]`` or ``[T, hc, D]`` (cast to ``emb``'s dtype)."""
        h = prev.to(emb.dtype).reshape(emb.shape[0], self.hc, -1)
        return self.h_proj(self.hnorm(h)) + self.e_proj(self.enorm(emb)).unsqueeze(1)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """Output streams ``[n, hc * D]`` -> the normed hidden ``[n, D]`` the head reads."""
        return self.norm(self.hc_head(streams.reshape(streams.shape[0], self.hc, -1)))


def mtp_step(model, depth: int, input_ids: torch.Tensor, prev_hidden: torch.Tensor, q_lens: list[int],
             states: list[SequenceState], paged=None) -> torch.Tensor:
    """MTP layer ``depth`` over the next ``q_lens[r]`` positions of sequence ``r`` (the standalone form:
    ``states[r]`` is `DeepseekV4ForCausalLM.new_mtp_state`'s, updated in place, its ``seq_len`` the first
    position). input_ids int64 ``[T]``: the token *after* each position; prev_hidden ``[T, hc * D]``: the
    main model's streams at each position (or the previous step's output) -> the block's output streams
    ``[T, hc * D]`` in the model dtype. ``paged``: a DECODE step's pages for the paged decode kernel
    (``models.v4.paged_decode``)."""
    if len(q_lens) != len(states) or sum(q_lens) != input_ids.shape[0] or prev_hidden.shape[0] != input_ids.shape[0]:
        raise ValueError(f"q_lens {q_lens} must give one length per state ({len(states)}) summing to the "
                         f"{input_ids.shape[0]} tokens and {prev_hidden.shape[0]} hidden rows")
    mtp = model.mtp[depth]
    ranges, positions = sequence_positions(q_lens, [st.seq_len for st in states], input_ids.device)
    x = mtp.inputs(model.embed(input_ids), prev_hidden)
    rope = {label: rot(positions, x.dtype) for label, rot in model.rotary.items()}
    x = mtp(x, input_ids, positions, rope, ranges, [st.layers[0] for st in states], model.rotary["compress"],
            paged)
    for n, st in zip(q_lens, states):
        st.seq_len += n
    return x.flatten(1)


def paged_mtp_forward(model, batch: V4Batch, prev_hidden: torch.Tensor, cache, depth: int = 0, draft: bool = True,
                      rows: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`mtp_step` over ``batch``'s requests with MTP layer ``depth``'s keys in their ``swa`` pages (cache
    layer ``num_hidden_layers + depth``): loaded before, what the step added written after. Returns
    (fp32 draft logits ``[T, vocab]``, or None without ``draft``; output streams ``[T, hc * D]``), only the
    ``rows`` (int64 ``[n]``) of both when given (every row still writes its cache entry). A DECODE batch (a
    chained draft step) attends through the model's paged decode kernel when it has one
    (``DeepseekV4ForCausalLM.set_decode_kernel``), as the main layers' DECODE forwards do."""
    states = [load_mtp_state(model, cache, pages, start, depth)
              for pages, start in zip(batch.page_tables, batch.starts)]
    paged = None
    if batch.mode is ForwardMode.DECODE and model.decode_kernel is not None:
        paged = PagedDecode.of(cache, batch.page_tables, batch.starts, batch.q_lens, *model.decode_kernel)
    x = mtp_step(model, depth, batch.input_ids, prev_hidden, list(batch.q_lens), states, paged)
    for pages, start, st in zip(batch.page_tables, batch.starts, states):
        store_mtp_state(model, cache, pages, st, start, depth)
    if rows is not None:
        x = x.index_select(0, rows.to(x.device))
    logits = model.mtp_logits(x, depth) if draft else None
    return logits, x
