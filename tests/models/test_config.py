"""models.config: parsing, raw re-reads, the layer top-k plan and every ConfigError rule."""

from __future__ import annotations

import dataclasses
import json

import pytest

import models.config as mc
from models.config import ConfigError, compute_topk_plan, config_from_dict, load_config
from models.tiny import tiny_config_kwargs


def mlp_layer_type(cfg: mc.ModelConfig, layer: int) -> str:
    """"dense" or "sparse" (MoE) for a main layer; MTP layers are always "sparse"."""
    if not 0 <= layer < cfg.num_layers_with_mtp:
        raise IndexError(f"layer {layer} out of range [0, {cfg.num_layers_with_mtp})")
    return "sparse" if layer >= cfg.num_hidden_layers else cfg.mlp_layer_types[layer]

# --------------------------------------------------------------------------- top-k plan


@pytest.mark.parametrize(
    "num_layers,freq,offset",
    [(8, 2, 1), (8, 2, 2), (9, 2, 3), (10, 3, 1), (10, 3, 2), (12, 4, 3), (7, 1, 1), (6, 2, 7), (78, 4, 3)],
)
def test_plan_matches_transformers_freq_offset(num_layers, freq, offset):
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(num_hidden_layers=num_layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    plan = compute_topk_plan(num_layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    assert list(plan.computes) == [t == "full" for t in hf.indexer_types]


@pytest.mark.parametrize("num_layers,freq", [(8, 2), (9, 3), (5, 1)])
def test_plan_without_offset_matches_transformers(num_layers, freq):
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(num_hidden_layers=num_layers, index_topk_freq=freq)
    plan = compute_topk_plan(num_layers, index_topk_freq=freq)
    assert list(plan.computes) == [t == "full" for t in hf.indexer_types]
    # The documented rule: shared iff max(l - 1, 0) % freq != 0.
    assert list(plan.computes) == [max(l - 1, 0) % freq == 0 for l in range(num_layers)]


def test_plan_sources_and_mtp():
    plan = compute_topk_plan(6, index_topk_freq=2, index_skip_topk_offset=1, mtp_layers=2)
    assert plan.computes == (True, False, True, False, True, False, True, True)
    assert plan.source == (0, 0, 2, 2, 4, 4, 6, 7)
    assert plan.has_sharing
    assert plan.num_layers == 6 and plan.num_mtp_layers == 2
    assert plan.computing_layers == (0, 2, 4, 6, 7)


def test_plan_no_sharing_by_default():
    for freq in (None, 1):
        plan = compute_topk_plan(4, index_topk_freq=freq, mtp_layers=1)
        assert plan.computes == (True,) * 5
        assert plan.source == (0, 1, 2, 3, 4)
        assert not plan.has_sharing


def test_plan_priority_indexer_types_over_pattern_over_freq():
    types = ["full", "full", "shared", "full"]
    plan = compute_topk_plan(4, indexer_types=types, index_topk_pattern="FSSS", index_topk_freq=2)
    assert plan.computes == (True, True, False, True)
    plan = compute_topk_plan(4, index_topk_pattern="FSSF", index_topk_freq=1)
    assert plan.computes == (True, False, False, True)
    assert plan.source == (0, 0, 0, 3)
    plan = compute_topk_plan(4, index_topk_pattern=["F", "F", "S", "S"])
    assert plan.source == (0, 1, 1, 1)


def test_plan_pattern_matches_transformers():
    from transformers import GlmMoeDsaConfig

    pattern = "FFSFSSF"
    hf = GlmMoeDsaConfig(num_hidden_layers=7, index_topk_pattern=pattern)
    assert list(compute_topk_plan(7, index_topk_pattern=pattern).computes) == [t == "full" for t in hf.indexer_types]


def test_plan_error_offset_not_positive():
    with pytest.raises(ConfigError, match=r"index_skip_topk_offset must be >= 1, got 0"):
        compute_topk_plan(4, index_topk_freq=2, index_skip_topk_offset=0)


def test_plan_error_freq_not_positive():
    with pytest.raises(ConfigError, match=r"index_topk_freq must be >= 1, got -2"):
        compute_topk_plan(4, index_topk_freq=-2, index_skip_topk_offset=1)


def test_plan_error_pattern_length():
    with pytest.raises(ConfigError, match=r"index_topk_pattern has length 3 but num_hidden_layers is 4: 'FSF'"):
        compute_topk_plan(4, index_topk_pattern="FSF")


def test_plan_error_indexer_types_length():
    with pytest.raises(ConfigError, match=r"indexer_types has 2 entries but num_hidden_layers is 3"):
        compute_topk_plan(3, indexer_types=["full", "shared"])


def test_plan_error_unknown_pattern_char():
    with pytest.raises(ConfigError, match=r"index_topk_pattern\[2\] is 'X'"):
        compute_topk_plan(4, index_topk_pattern="FSXF")


def test_plan_error_unknown_indexer_type():
    with pytest.raises(ConfigError, match=r"indexer_types\[1\] is 'sparse'"):
        compute_topk_plan(3, indexer_types=["full", "sparse", "full"])


def test_plan_error_shared_without_earlier_computing_layer():
    with pytest.raises(ConfigError, match=r"layer 0 is 'shared' but no layer before it computes"):
        compute_topk_plan(3, index_topk_pattern="SFF")
    with pytest.raises(ConfigError, match=r"layer 0 is 'shared'"):
        compute_topk_plan(2, indexer_types=["shared", "full"])


def test_plan_error_freq_not_integer():
    with pytest.raises(ConfigError, match=r"index_topk_freq must be an integer >= 1, got 2.5"):
        compute_topk_plan(4, index_topk_freq=2.5)


# --------------------------------------------------------------------------- load_config


def test_load_tiny_deepseek_v32(tiny_dirs):
    cfg = load_config(tiny_dirs["deepseek_v32"])
    assert cfg.arch == "deepseek_v32"
    assert cfg.indexer_rope_interleave is False
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 4, 8)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        48, 32, 16, 16, 16,
    )
    assert cfg.qk_head_dim == 32 and cfg.kv_cache_dim == 48
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (8, 2, 1, 2)
    assert cfg.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert mlp_layer_type(cfg, 0) == "dense" and mlp_layer_type(cfg, 4) == "sparse"
    assert cfg.num_nextn_predict_layers == 1 and cfg.num_layers_with_mtp == 5 and cfg.has_mtp
    assert not cfg.topk_plan.has_sharing and len(cfg.topk_plan.computes) == 5
    assert cfg.bos_token_id == 256 and cfg.eos_token_ids == (257,)
    assert cfg.weight_block_size is None and not cfg.is_fp8
    assert cfg.rope_type == "yarn" and cfg.rope_parameters["factor"] == 4.0
    assert cfg.hf_config.head_dim == cfg.qk_rope_head_dim
    assert cfg.index_topk == 16 and cfg.index_n_heads == 8 and cfg.index_head_dim == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1
    assert hash(cfg) == hash(load_config(tiny_dirs["deepseek_v32"]))
    assert cfg == load_config(tiny_dirs["deepseek_v32"])


def test_load_tiny_glm(tiny_dirs):
    cfg = load_config(tiny_dirs["glm_moe_dsa"])
    assert cfg.arch == "glm_moe_dsa"
    assert cfg.indexer_rope_interleave is True
    assert cfg.topk_plan.computes == (True, False, True, False, True)
    assert cfg.topk_plan.source == (0, 0, 2, 2, 4)
    assert cfg.topk_plan.has_sharing
    assert cfg.n_group == 1 and cfg.rope_type == "default"


def _raw(arch="glm_moe_dsa", **changes):
    raw = {"model_type": arch, **tiny_config_kwargs(arch)}
    for k, v in changes.items():
        if v is _DROP:
            raw.pop(k, None)
        else:
            raw[k] = v
    return raw


_DROP = object()


def test_raw_head_dim_does_not_override_qk_rope_head_dim(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw(head_dim=128, qk_rope_head_dim=16)))
    cfg = load_config(tmp_path)
    assert cfg.qk_rope_head_dim == 16
    assert cfg.hf_config.head_dim == 16 and cfg.hf_config.qk_rope_head_dim == 16


def test_raw_reread_survives_a_clobbering_transformers(monkeypatch):
    # Emulate a transformers version that derives qk_rope_head_dim from head_dim
    # and drops the top-k sharing fields and num_nextn_predict_layers.
    original = mc._build_hf_config

    def clobbering(raw):
        hf = original(raw)
        hf.qk_rope_head_dim = 64
        hf.head_dim = 64
        hf.indexer_types = ["full"] * hf.num_hidden_layers
        for name in ("index_topk_freq", "index_skip_topk_offset", "num_nextn_predict_layers"):
            if hasattr(hf, name):
                delattr(hf, name)
        return hf

    monkeypatch.setattr(mc, "_build_hf_config", clobbering)
    raw = _raw(num_hidden_layers=6, index_topk_freq=3, index_skip_topk_offset=2, head_dim=64)
    raw.pop("indexer_types", None)
    cfg = config_from_dict(raw)
    assert cfg.qk_rope_head_dim == 16 and cfg.hf_config.head_dim == 16
    assert cfg.topk_plan.computes == (True, True, False, False, True, False, True)
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.hf_config.indexer_types == ["full", "full", "shared", "shared", "full", "shared"]


def test_raw_pattern_and_indexer_types_are_read():
    cfg = config_from_dict(_raw(index_topk_pattern="FFSF", index_topk_freq=_DROP, index_skip_topk_offset=_DROP))
    assert cfg.topk_plan.computes[:4] == (True, True, False, True)
    cfg = config_from_dict(_raw(indexer_types=["full", "shared", "shared", "full"]))
    assert cfg.topk_plan.computes[:4] == (True, False, False, True)


def test_mtp_absent_means_zero():
    cfg = config_from_dict(_raw("deepseek_v32", num_nextn_predict_layers=_DROP))
    assert cfg.num_nextn_predict_layers == 0 and cfg.num_layers_with_mtp == cfg.num_hidden_layers


def test_eos_list_and_fp8_block():
    raw = _raw("deepseek_v32", eos_token_id=[257, 1])
    raw["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }
    cfg = config_from_dict(raw)
    assert cfg.eos_token_ids == (257, 1)
    assert cfg.weight_block_size == (128, 128) and cfg.is_fp8


# One test per ConfigError rule of load_config / config_from_dict.
_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
CONFIG_ERRORS = {
    "unknown_model_type": (dict(model_type="llama"), r"model_type 'llama' is not supported"),
    "missing_model_type": (dict(model_type=_DROP), r"model_type None is not supported"),
    "unknown_quant_method": (
        dict(quantization_config={"quant_method": "awq", "bits": 4}),
        r"quantization_config.quant_method 'awq' is not supported",
    ),
    "fp8_fmt": (dict(quantization_config={**_FP8, "fmt": "e5m2"}), r"quantization_config.fmt 'e5m2'"),
    "fp8_block_missing": (
        dict(quantization_config={"quant_method": "fp8"}),
        r"quantization_config.weight_block_size must be two positive integers, got None",
    ),
    "fp8_block_bad": (
        dict(quantization_config={**_FP8, "weight_block_size": [128, 0]}),
        r"weight_block_size must be two positive integers, got \[128, 0\]",
    ),
    "qk_rope_odd": (dict(qk_rope_head_dim=15), r"qk_rope_head_dim must be a positive even number, got 15"),
    "index_head_dim_small": (dict(index_head_dim=8), r"index_head_dim \(8\) must be >= qk_rope_head_dim \(16\)"),
    "q_lora_rank_none": (dict(q_lora_rank=None), r"q_lora_rank.*None"),
    "mlp_layer_types_value": (
        dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]),
        r"mlp_layer_types\[1\] is 'moe'",
    ),
    "mlp_layer_types_length": (
        dict(mlp_layer_types=["dense", "sparse"]),
        r"mlp_layer_types has 2 entries but num_hidden_layers is 4",
    ),
    "n_group_divides": (dict(n_group=3), r"n_group 3 must be positive and divide n_routed_experts \(8\)"),
    "topk_group_range": (dict(topk_group=2), r"topk_group 2 must be in \[1, n_group=1\]"),
    "experts_per_tok_range": (
        dict(num_experts_per_tok=9),
        r"num_experts_per_tok 9 must be in \[1, n_routed_experts=8\]",
    ),
    "index_topk_positive": (dict(index_topk=0), r"index_topk must be >= 1, got 0"),
    "mtp_negative": (dict(num_nextn_predict_layers=-1), r"num_nextn_predict_layers must be >= 0, got -1"),
    "mtp_not_int": (dict(num_nextn_predict_layers="1"), r"num_nextn_predict_layers must be an integer, got '1'"),
    "qk_rope_not_int": (dict(qk_rope_head_dim=16.0), r"qk_rope_head_dim must be an integer, got 16.0"),
    "eos_bad": (dict(eos_token_id="eos"), r"eos_token_id"),
    "transformers_rejects": (dict(hidden_size="big"), r"hidden_size.*'big'"),
    "topk_plan_rule": (
        dict(indexer_types=["shared", "full", "full", "full"]),
        r"layer 0 is 'shared' but no layer before it computes",
    ),
    "topk_freq_rule": (
        dict(indexer_types=_DROP, index_topk_freq=0),
        r"index_topk_freq must be >= 1, got 0",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_config_error_rule(case, tmp_path):
    changes, pattern = CONFIG_ERRORS[case]
    (tmp_path / "config.json").write_text(json.dumps(_raw(**changes)))
    with pytest.raises(ConfigError, match=pattern):
        load_config(tmp_path)


def test_config_error_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config.json not readable at '.*nowhere"):
        load_config(tmp_path / "nowhere")


def test_config_error_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"is not valid JSON"):
        load_config(tmp_path)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
