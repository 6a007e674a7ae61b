"""The peer harness's checkpoint maker: DeepSeek-V3.2's dims by default, the release's
format (fp8 block scales, quantization_config, MTP layer), loadable by transformers and by us."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from bench.peers.checkpoint import DSV32_SHAPES, dsv32_shaped_kwargs, make_checkpoint
from models.config import load_config
from models.weights import checkpoint_files
from workers.offline import LLM

# Shrunk attention / MoE dims so the CPU test runs in seconds; every other field is DeepSeek-V3.2's.
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
             v_head_dim=16, index_n_heads=4, index_head_dim=32, index_topk=16)


def test_default_dims_are_deepseek_v32s():
    kw = dsv32_shaped_kwargs(layers=4, experts=16)
    assert {k: kw[k] for k in DSV32_SHAPES if k != "num_nextn_predict_layers"} == {
        k: v for k, v in DSV32_SHAPES.items() if k != "num_nextn_predict_layers"}
    assert (kw["num_hidden_layers"], kw["n_routed_experts"], kw["n_group"], kw["topk_group"]) == (4, 16, 8, 4)
    assert dsv32_shaped_kwargs(4, 12)["n_group"] == 1
    with pytest.raises(ValueError, match="--experts must be >= 8"):
        dsv32_shaped_kwargs(4, 4)


@pytest.mark.parametrize("fp8", [False, True])
def test_checkpoint_loads_in_transformers_format_and_here(tmp_path, fp8):
    out = make_checkpoint(tmp_path / "ckpt", layers=3, experts=8, fp8=fp8, mtp=True, **SMALL)
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v32" and raw["architectures"] == ["DeepseekV32ForCausalLM"]
    assert raw["rope_parameters"]["rope_type"] == "yarn" and raw["index_topk"] == 16
    assert (raw["topk_method"], raw["scoring_func"]) == ("noaux_tc", "sigmoid")  # what vLLM's loader keys on
    names = set()
    for f in checkpoint_files(out):
        with safe_open(str(f), framework="pt") as h:
            names |= set(h.keys())
    assert "model.layers.3.eh_proj.weight" in names  # the MTP layer, after the 3 decoder layers
    scales = {n for n in names if n.endswith("weight_scale_inv")}
    if fp8:
        assert raw["quantization_config"]["weight_block_size"] == [128, 128]
        assert any(".mlp.experts." in n for n in scales) and any(".self_attn.indexer." in n for n in scales)
    else:
        assert not scales and "quantization_config" not in raw
    cfg = load_config(out)
    assert cfg.num_nextn_predict_layers == 1 and cfg.n_routed_experts == 8
    llm = LLM(out, kv_cache_dtype="fp8", num_pages=16, mtp_draft_tokens=1)
    got = llm.generate([[1, 2, 3, 4, 5]], max_new_tokens=4, ignore_eos=True)[0]
    assert len(got) == 4 and got == LLM(out, kv_cache_dtype="fp8", num_pages=16).generate(
        [[1, 2, 3, 4, 5]], max_new_tokens=4, ignore_eos=True)[0]
