"""models.registry dispatch, DeepSeek-V4 config checks and checkpoint-name map."""

from __future__ import annotations

import json

import pytest

from models.config import ConfigError, ModelConfig
from models.registry import REGISTRY, arch_spec, load_any_config
from models.v4.config import v4_config_from_dict
from models.v4.loader import v4_module_name


def test_registry_knows_every_family():
    assert sorted(REGISTRY) == ["deepseek_v32", "deepseek_v4", "glm_moe_dsa"]
    with pytest.raises(ConfigError, match=r"model_type 'llama' is not supported; expected one of \['deepseek_v32'"):
        arch_spec("llama")
    with pytest.raises(ConfigError, match="model_type None"):
        arch_spec(None)


def test_dsa_config_through_the_registry(tiny_dirs):
    cfg = load_any_config(tiny_dirs["glm_moe_dsa"])
    assert isinstance(cfg, ModelConfig) and cfg.arch == "glm_moe_dsa"
    assert arch_spec("glm_moe_dsa").cache_groups is None


def test_unreadable_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json not readable"):
        load_any_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_any_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_key_value_heads": 2}))
    with pytest.raises(ConfigError, match="num_key_value_heads must be 1"):
        load_any_config(tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("scoring_func", "softmax", "scoring_func 'softmax' is not supported"),
    ("o_groups", 3, r"o_groups 3 must divide num_attention_heads \(64\)"),
    ("n_shared_experts", 2, "n_shared_experts must be 1"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("index_head_dim", 32, r"index_head_dim \(32\) must be >= qk_rope_head_dim \(64\)"),
    ("sliding_window", 0, "sliding_window must be an integer >= 1"),
    ("rope_parameters", {"main": {"rope_type": "default", "rope_theta": 1e4},
                         "compress": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.compress.rope_type 'dynamic' is not supported"),
])
def test_v4_config_errors_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        v4_config_from_dict({"model_type": "deepseek_v4", field: value})


def test_v4_default_config_is_v4_flash_shaped():
    cfg = v4_config_from_dict({"model_type": "deepseek_v4"})
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.sliding_window, cfg.hc_mult) == (512, 64, 128, 4)
    assert [cfg.compress_ratio(i) for i in range(4)] == [128, 128, 128, 4]
    assert cfg.mlp_layer_types[:4] == ("hash_moe", "hash_moe", "hash_moe", "moe")
    assert cfg.has_indexer(3) and not cfg.has_indexer(0)


def test_v4_checkpoint_names():
    cfg = v4_config_from_dict({"model_type": "deepseek_v4", "num_hidden_layers": 2})
    name = lambda n: v4_module_name(n, cfg)  # noqa: E731
    # DeepSeek's release names and transformers' save_pretrained spellings of the same tensors.
    assert name("embed.weight") == name("model.embed_tokens.weight") == "embed.weight"
    assert name("head.weight") == name("lm_head.weight") == "head.weight"
    assert name("hc_head_fn") == name("model.hc_head.hc_fn") == "hc_head.fn"
    assert name("model.norm.weight") == "norm.weight"
    assert name("layers.1.hc_ffn_scale") == "layers.1.hc_ffn.scale"
    assert name("model.layers.0.attn.indexer.compressor.ape") == "layers.0.attn.indexer.compressor.ape"
    assert name("layers.0.ffn.experts.7.w1.weight") == "layers.0.ffn.experts.7.gate_proj.weight"
    assert name("layers.0.ffn.experts.7.w3.weight") == "layers.0.ffn.experts.7.up_proj.weight"
    assert name("layers.0.ffn.experts.7.w2.weight") == "layers.0.ffn.experts.7.down_proj.weight"
    assert name("layers.0.ffn.shared_experts.w2.weight") == "layers.0.ffn.shared_experts.w2.weight"
    # Not held: anything past the main stack.
    assert name("layers.2.attn.wq_a.weight") is None
    # The MTP layer (num_nextn_predict_layers 1 here): its own tensors, and its block's named as a main layer's.
    assert name("mtp.0.e_proj.weight") == "mtp.0.e_proj.weight" and name("mtp.0.hnorm.weight") == "mtp.0.hnorm.weight"
    assert name("mtp.0.hc_head_scale") == "mtp.0.hc_head.scale" and name("mtp.0.hc_attn_fn") == "mtp.0.hc_attn.fn"
    assert name("mtp.0.ffn.experts.3.w2.weight") == "mtp.0.ffn.experts.3.down_proj.weight"
    assert name("model.mtp.0.attn.wkv.weight") == "mtp.0.attn.wkv.weight"
    # Copies of the shared embedding / head, a second MTP layer the config does not declare, MTP off: not read.
    assert name("mtp.0.head.weight") is None and name("mtp.0.emb.tok_emb.weight") is None
    assert name("mtp.1.e_proj.weight") is None and v4_module_name("mtp.0.e_proj.weight", cfg, with_mtp=False) is None
