"""Tiny random DeepSeek-V4 checkpoints built and saved by transformers' own
``DeepseekV4ForCausalLM``, for checking ``models.v4`` against it.

Dimensions deliberately differ from the real model's (head_dim 512, rope 64,
window 128, rates 4 / 128, 4 streams) so no shape is silently hard-coded;
windows and compression rates are small so a 40-token prompt crosses several
windows and compressed blocks, and ``index_topk`` is below the number of
compressed entries so the indexer really selects. ``num_nextn_predict_layers`` is 0:
transformers builds no MTP layer, so its checkpoint holds none (``models.v4`` would
refuse a config that declares one whose weights are missing).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.tiny_v4 import perturb_v4_constants_

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

BASE = dict(
    vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=48, q_lora_rank=40, partial_rotary_factor=16 / 48,
    num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=24,
    index_n_heads=4, index_head_dim=24, index_topk=3, sliding_window=8,
    compress_rates={CSA: 4, HCA: 8}, layer_types=[SWA, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=3, hc_sinkhorn_iters=6,
    max_position_embeddings=512, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
    num_nextn_predict_layers=0,
)

CONFIGS = {
    # Every layer type, hash routing first, sqrt-softplus scores.
    "v4_mixed": {},
    # YaRN on the compress rope, odd rates and dims, sigmoid scores, two streams.
    "v4_yarn_odd": dict(
        head_dim=40, partial_rotary_factor=0.2, num_attention_heads=6, o_groups=3, o_lora_rank=20,
        sliding_window=6, compress_rates={CSA: 3, HCA: 5}, index_topk=5, index_head_dim=16, index_n_heads=3,
        num_hidden_layers=3, layer_types=[HCA, CSA, SWA], mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        hc_mult=2, scoring_func="sigmoid", num_experts_per_tok=3,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32, "beta_slow": 1}),
    # transformers' default schedule (HCA, HCA, HCA, CSA, HCA); its config.json
    # is rewritten with the legacy fields (`LEGACY`) that the config folds in.
    "v4_legacy_fields": dict(
        layer_types=None, mlp_layer_types=None, num_hidden_layers=5, compress_rates={CSA: 2, HCA: 6},
        sliding_window=5, index_topk=4,
        mlp_layer_types_default_hash=1),
}

# config.json fields of "v4_legacy_fields" as older V4 configs spell them.
LEGACY = dict(compress_rate_csa=2, compress_rate_hca=6, num_hash_layers=1, qk_rope_head_dim=16)
_DROP_FOR_LEGACY = ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters")


def build_hf_v4(name: str, seed: int = 0):
    """transformers' ``DeepseekV4ForCausalLM`` of config ``name`` with random weights,
    including the parts its init leaves constant: sinks, position biases and
    hyper-connection biases random, norm weights off 1, a random hash table."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw = {**BASE, **CONFIGS[name]}
    n_hash = kw.pop("mlp_layer_types_default_hash", None)
    kw = {k: v for k, v in kw.items() if v is not None}
    if n_hash is not None:
        kw["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (kw["num_hidden_layers"] - n_hash)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kw)).eval()
    perturb_v4_constants_(model, torch.Generator().manual_seed(seed + 1))
    return model


def save_hf_v4(name: str, out: Path, seed: int = 0):
    """Save ``build_hf_v4(name)`` to ``out``; returns the model. "v4_legacy_fields" gets a
    config.json in the legacy spelling (transformers reads both to the same config)."""
    model = build_hf_v4(name, seed)
    model.save_pretrained(out)
    if name == "v4_legacy_fields":
        path = Path(out) / "config.json"
        raw = json.loads(path.read_text())
        raw = {k: v for k, v in raw.items() if k not in _DROP_FOR_LEGACY} | LEGACY
        path.write_text(json.dumps(raw, indent=2))
    return model
