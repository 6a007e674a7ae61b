"""Tiny random checkpoints built and saved by transformers itself, for
checking our model against transformers' ``deepseek_v32`` / ``glm_moe_dsa``."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
    index_n_heads=8, index_head_dim=32, index_topk=12,
    first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.08,
    bos_token_id=0, eos_token_id=1,
)

# name -> (arch, overrides). Dimensions deliberately differ from the real
# models' (512/64 latent/rope, 128 heads) so no shape is silently hard-coded.
CONFIGS = {
    "v32_sparse": ("deepseek_v32", dict(n_group=4, topk_group=2)),
    "v32_yarn_odd_dims": ("deepseek_v32", dict(
        kv_lora_rank=24, qk_rope_head_dim=8, num_attention_heads=3, num_key_value_heads=3, index_topk=7,
        n_group=2, topk_group=1, index_head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
    "glm_share_freq2_off3": ("glm_moe_dsa", dict(num_hidden_layers=5, index_topk_freq=2, index_skip_topk_offset=3,
                                                 n_group=1, topk_group=1)),
    "glm_share_freq3": ("glm_moe_dsa", dict(num_hidden_layers=5, index_topk_freq=3, index_skip_topk_offset=1,
                                            n_group=1, topk_group=1, index_topk=20)),
}


def build_hf_model(arch: str, overrides: dict, seed: int = 0):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    kw = dict(BASE)
    kw.update(overrides)
    cfg_cls, model_cls = {
        "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
        "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw))
    # A random router bias, so noaux_tc's biased selection is really exercised.
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    return model.eval()


def save_hf_model(name: str, out: Path, seed: int = 0):
    arch, overrides = CONFIGS[name]
    model = build_hf_model(arch, overrides, seed)
    model.save_pretrained(out)
    return model


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """``Tensor.topk`` by a stable sort: among equal values the lower index first."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def use_tie_rule(model):
    """Make transformers' DSA indexers break exact index-score ties by our
    documented rule (attention/API.md: the lower position wins), in place.

    transformers selects with ``index_scores.topk``, whose choice among equal
    scores is arbitrary (it changes with the row width); our backends follow
    one rule, so a prompt with an exact tie at the top-k boundary (every
    head's ReLU zero: several scores 0.0) is only comparable under the same
    rule. ``Tensor.topk`` is swapped for a stable one during each indexer
    forward only (the MoE router's top-k is left alone)."""
    for module in model.modules():
        if not type(module).__name__.endswith("Indexer"):
            continue
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            saved = torch.Tensor.topk
            torch.Tensor.topk = _stable_topk
            try:
                return _inner(*args, **kwargs)
            finally:
                torch.Tensor.topk = saved

        module.forward = forward
    return model
