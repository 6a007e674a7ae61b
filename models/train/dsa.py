"""The training forward of a DeepSeek-V3.2 model: dense or sparse attention, indexer KL, MoE, MTP.

Parameters live in transformers' own modules (``DeepseekV32ForCausalLM`` for
the main stack, a ``DeepseekV32DecoderLayer`` for the MTP block), so the
exported checkpoint is what ``save_pretrained`` writes and every name is the
one both loaders read. The forward is written here because the inference
paths cannot train: transformers' indexer runs under ``no_grad`` and has no
MTP layer; ours (`models.model`) runs over paged caches.

The math is the inference math (tests compare the logits with transformers'
in both attention modes):

- MLA in the expanded form, softmax scale of ``DeepseekV32Attention``;
- the lightning indexer, ``I[t, s] = sum_h w_h relu(q_h . k_s) * d^-1/2 * H^-1/2``
  with half-split RoPE on its first ``qk_rope_head_dim`` channels;
- ``sparse``: each query attends to the causal positions among the
  ``index_topk`` of highest ``I`` (all of them while ``t < index_topk``; equal
  scores: the lower position first, as at inference);
- MoE: sigmoid router with the correction bias and group-limited top-k (run
  in float32 as at inference); every expert computes every token and the
  outputs are mixed with the routing weights (zero for unrouted experts, so
  the result and the gradients equal routed computation: cheaper than
  gathering at this size);
- MTP: ``h' = eh_proj([enorm(emb(t[i+1])); hnorm(h_i)])`` through the MTP
  decoder layer, ``shared_head`` (its norm, then the main ``lm_head``)
  predicts ``t[i+2]``; ``h_i`` is the main stack's final normed hidden state,
  as `models.model.MTPLayer` reads it.

The indexer is trained as in DeepSeek-V3.2 (arXiv 2512.02556, section 2.1):
its inputs are detached (only its own loss trains it) and its loss is
``KL(p_t || softmax(I_t))`` where ``p_t`` is the main attention
distribution of query ``t`` summed over heads and L1-normalised; in
``sparse`` mode both are restricted to the selected positions.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["DsaTrainModel", "MODES"]

MODES = ("dense", "sparse")


def _hf():
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    return m


class MTPBlock(nn.Module):
    """The MTP layer's own weights (embedding and head are the main model's, as in the release)."""

    def __init__(self, cfg, layer_cfg):
        super().__init__()
        m = _hf()
        self.enorm = m.DeepseekV32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = m.DeepseekV32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = m.DeepseekV32DecoderLayer(layer_cfg, 0)
        self.head_norm = m.DeepseekV32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DsaTrainModel(nn.Module):
    """``cfg_kwargs``: transformers ``DeepseekV32Config`` kwargs (`models.train.arch`), with
    ``num_nextn_predict_layers`` 0 or 1.

    Parameter groups: :meth:`indexer_parameters` (trained only by the indexer
    loss) and :meth:`main_parameters` (everything else).
    """

    def __init__(self, cfg_kwargs: dict):
        super().__init__()
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

        from models.tiny import mtp_layer_config_kwargs

        self.cfg_kwargs = dict(cfg_kwargs)
        n_mtp = int(cfg_kwargs.get("num_nextn_predict_layers", 0))
        if n_mtp not in (0, 1):
            raise ValueError(f"num_nextn_predict_layers must be 0 or 1 for training, got {n_mtp}")
        self.config = DeepseekV32Config(**cfg_kwargs)
        self.lm = DeepseekV32ForCausalLM(self.config)
        self.mtp_config = DeepseekV32Config(**mtp_layer_config_kwargs(
            dict(cfg_kwargs, num_nextn_predict_layers=0), "deepseek_v32"))
        self.mtp = MTPBlock(self.config, self.mtp_config) if n_mtp else None
        if self.mtp is not None:
            for module in self.mtp.modules():
                self.lm._init_weights(module)
            with torch.no_grad():
                for norm in (self.mtp.enorm, self.mtp.hnorm, self.mtp.head_norm):
                    norm.weight.fill_(1.0)

    # ------------------------------------------------------------------ parameters
    def indexer_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if ".indexer." in n]

    def main_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if ".indexer." not in n]

    def decoder_layers(self) -> list[nn.Module]:
        """Main layers, then the MTP layer."""
        return list(self.lm.model.layers) + ([self.mtp.layer] if self.mtp is not None else [])

    def routers(self) -> list[nn.Module]:
        m = _hf()
        return [l.mlp.gate for l in self.decoder_layers() if isinstance(l.mlp, m.DeepseekV32MoE)]

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, mode: str, train_main: bool = True) -> dict:
        """tokens: int64 ``[B, S + 2]`` (main inputs ``[:, :S]``, targets ``[:, 1:S+1]``; the MTP
        layer reads ``[:, 1:S+1]`` and predicts ``[:, 2:]``; without MTP ``[B, S + 1]`` is enough).

        ``train_main`` False: only the indexer loss has a graph (the warm-up stage).

        Returns fp32 scalars ``lm_loss``, ``mtp_loss`` (None without MTP), ``indexer_kl``
        (mean over layers and queries), and ``expert_load`` int64 ``[n_moe_layers, n_experts]``.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        need = 2 if self.mtp is not None else 1
        S = tokens.shape[1] - need
        if S < 1:
            raise ValueError(f"tokens must be [B, S + {need}] with S >= 1, got {tuple(tokens.shape)}")
        stats = {"kl": [], "load": [], "indexer_grad": torch.is_grad_enabled()}
        with torch.set_grad_enabled(train_main and torch.is_grad_enabled()):
            hidden, cos, sin = self._main(tokens[:, :S], mode, stats)
            lm_loss = F.cross_entropy(self.lm.lm_head(hidden).float().flatten(0, 1), tokens[:, 1:S + 1].flatten())
            mtp_loss = None
            if self.mtp is not None:
                logits = self._mtp_logits(tokens[:, 1:S + 1], hidden, cos, sin, mode, stats)
                mtp_loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:S + 2].flatten())
        return {"lm_loss": lm_loss, "mtp_loss": mtp_loss, "indexer_kl": torch.stack(stats["kl"]).mean(),
                "expert_load": torch.stack(stats["load"]) if stats["load"] else None}

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(main fp32 logits ``[B, S, vocab]``, MTP fp32 logits ``[B, S - 1, vocab]`` or None).

        MTP row ``i`` predicts token ``i + 2`` from ``input_ids[:, i + 1]`` and the main hidden
        state at ``i`` (the last position has no next token here and gets no row).
        """
        stats = {"kl": [], "load": [], "indexer_grad": False}
        hidden, cos, sin = self._main(input_ids, mode, stats)
        main = self.lm.lm_head(hidden).float()
        if self.mtp is None or input_ids.shape[1] < 2:
            return main, None
        S = input_ids.shape[1] - 1
        mtp = self._mtp_logits(input_ids[:, 1:], hidden[:, :S], cos[:, :S], sin[:, :S], mode, stats)
        return main, mtp

    def _main(self, inputs, mode, stats):
        x = self.lm.model.embed_tokens(inputs)
        pos = torch.arange(inputs.shape[1], device=inputs.device)[None]
        cos, sin = self.lm.model.rotary_emb(x, pos)
        for layer in self.lm.model.layers:
            x = self._layer(layer, x, cos, sin, mode, stats)
        return self.lm.model.norm(x), cos, sin

    def _mtp_logits(self, next_ids, hidden, cos, sin, mode, stats):
        emb = self.lm.model.embed_tokens(next_ids)
        z = self.mtp.eh_proj(torch.cat([self.mtp.enorm(emb), self.mtp.hnorm(hidden)], dim=-1))
        z = self._layer(self.mtp.layer, z, cos, sin, mode, stats)
        return self.lm.lm_head(self.mtp.head_norm(z)).float()

    def _layer(self, layer, x, cos, sin, mode, stats):
        h = layer.input_layernorm(x)
        a, kl = _attention(layer.self_attn, h, cos, sin, mode, stats["indexer_grad"])
        stats["kl"].append(kl)
        x = x + a
        h = layer.post_attention_layernorm(x)
        if isinstance(layer.mlp, _hf().DeepseekV32MoE):
            m, load = _moe(layer.mlp, h)
            stats["load"].append(load)
        else:
            m = layer.mlp(h)
        return x + m


def _indexer_scores(ix, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, S, S]`` index scores of every (query, key) pair (no causal mask).

    x: ``[B, S, hidden]``, q_resid: ``[B, S, q_lora_rank]``; cos / sin ``[1, S, rope]``.
    """
    m = _hf()
    B, S, _ = x.shape
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(x)).unsqueeze(2)
    r = ix.qk_rope_head_dim
    q_rot, k_rot = m.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], dim=-1)
    k = torch.cat([k_rot, k[..., r:]], dim=-1)[:, :, 0]
    scores = F.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.softmax_scale)
    with torch.autocast(x.device.type, enabled=False):
        w = ix.weights_proj(x.float()) * ix.n_heads ** -0.5
    # [B, S, heads, S] is the largest tensor of the step: contracted in its own dtype (bf16 under
    # autocast, fp32 accumulation), never copied to fp32.
    return torch.einsum("bsht,bsh->bst", scores, w.to(scores.dtype)).float()


def _attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str, indexer_grad: bool):
    """(output ``[B, S, hidden]``, indexer KL fp32 scalar) of one MLA layer with its indexer.

    ``indexer_grad``: build the indexer loss's graph (also when the main model runs without one)."""
    m = _hf()
    B, S, _ = x.shape
    H, nope, rope, dv = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(B, S, H, nope + rope).transpose(1, 2)
    q_pass, q_rot = q.split([nope, rope], dim=-1)
    kv_pass, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rope], dim=-1)
    latent = attn.kv_a_layernorm(kv_pass)
    q_rot, k_rot = m.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(B, 1, S, rope), cos, sin)
    kv = attn.kv_b_proj(latent).view(B, S, H, nope + dv).transpose(1, 2)
    k_nope, v = kv.split([nope, dv], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(B, H, S, rope)], dim=-1)
    logits = torch.matmul(torch.cat([q_pass, q_rot], dim=-1), k.transpose(-1, -2)).float() * attn.scaling

    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    with torch.set_grad_enabled(indexer_grad):
        # Detached inputs: the indexer learns from its own loss only. Checkpointed: its
        # [B, S, heads, S] intermediate is recomputed in backward instead of held per layer.
        xi, qi = x.detach(), q_resid.detach()
        if indexer_grad:
            scores = checkpoint(_indexer_scores, attn.indexer, xi, qi, cos, sin, use_reentrant=False)
        else:
            scores = _indexer_scores(attn.indexer, xi, qi, cos, sin)
        scores = scores.masked_fill(~causal, float("-inf"))
        if mode == "sparse":
            topk = min(attn.indexer.index_topk, S)
            # A stable sort: among equal scores the lower position wins, the rule both
            # inference backends follow (attention/API.md), so training selects what serving will.
            picked = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[..., :topk]
            allowed = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picked, True) & causal
        else:
            allowed = causal.expand(B, S, S)
        logq = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)

    probs = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2).reshape(B, S, H * dv)
    with torch.set_grad_enabled(indexer_grad):
        p = probs.detach().sum(1)
        p = p / p.sum(-1, keepdim=True)
        # Zero-probability terms contribute 0 (p log p -> 0); masked positions have logq -inf.
        kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - logq), torch.zeros_like(p)).sum(-1).mean()
    return attn.o_proj(out), kl


def _moe(mlp, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(MoE output ``[B, S, hidden]``, int64 tokens per expert ``[n_experts]``)."""
    B, S, D = h.shape
    x = h.reshape(-1, D)
    with torch.autocast(x.device.type, enabled=False):  # routing in fp32, as at inference
        _, weights, idx = mlp.gate(x.float())
    E = mlp.experts.num_experts
    route = torch.zeros(x.shape[0], E, dtype=weights.dtype, device=x.device).scatter(1, idx, weights)
    gu = torch.einsum("nd,efd->enf", x, mlp.experts.gate_up_proj)
    g, u = gu.chunk(2, dim=-1)
    y = torch.einsum("enf,edf->end", mlp.experts.act_fn(g) * u, mlp.experts.down_proj)
    out = torch.einsum("end,ne->nd", y, route.to(y.dtype)).to(h.dtype) + mlp.shared_experts(x)
    load = torch.bincount(idx.flatten(), minlength=E)
    return out.view(B, S, D), load
