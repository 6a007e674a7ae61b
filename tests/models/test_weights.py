"""models.weights: fp8 block quantization, checkpoint reading (single, sharded, fp8)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ConfigError, load_config
from models.weights import (
    FP8_MAX,
    checkpoint_files,
    dequantize_fp8_block,
    fp8_scale_shape,
    is_fp8_quantizable,
    iter_checkpoint_tensors,
    load_checkpoint,
    quantize_fp8_block,
    write_fp8_checkpoint,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for
# normal values; below the smallest normal (2^-6) the spacing is 2^-9.
_REL, _SUB = 2.0**-4, 2.0**-10


def _assert_within_fp8_error(w, deq, scale, block):
    full = scale.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    bound = w.abs() * _REL + full * _SUB + 1e-12
    assert ((deq - w).abs() <= bound).all()


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((130, 260), (128, 128)), ((70, 33), (16, 32))])
def test_quant_dequant_roundtrip(shape, block):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])  # varied magnitudes per column
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == fp8_scale_shape(shape, block)
    deq = dequantize_fp8_block(q, s, block, torch.float32)
    _assert_within_fp8_error(w, deq, s, block)
    # Each block's largest magnitude maps to the fp8 maximum.
    assert q.float().abs().max() == FP8_MAX


def test_partial_edge_blocks_use_their_own_scale():
    block = (128, 128)
    w = torch.full((130, 260), 0.5)
    w[128:, :] = 1000.0  # bottom edge rows: a 2-row partial block with a large amax
    w[:128, 256:] = 1e-3  # right edge columns: a 4-column partial block with a small amax
    q, s = quantize_fp8_block(w, block)
    assert s.shape == (2, 3)
    assert torch.allclose(s, torch.tensor([[0.5, 0.5, 1e-3], [1000.0, 1000.0, 1000.0]]) / FP8_MAX)
    deq = dequantize_fp8_block(q, s, block, torch.float32)
    assert torch.allclose(deq, w, rtol=2.0**-4)


def test_zero_block_quantizes_to_zero():
    w = torch.zeros(4, 4)
    w[0, 0] = 3.0
    q, s = quantize_fp8_block(w, (2, 2))
    assert torch.isfinite(s).all() and (s > 0).all()
    deq = dequantize_fp8_block(q, s, (2, 2), torch.float32)
    assert torch.equal(deq, w)


def test_dequant_rejects_wrong_scale_shape():
    q, s = quantize_fp8_block(torch.randn(130, 64), (128, 128))
    with pytest.raises(ValueError, match=r"scale_inv shape \(1, 1\) does not match .* expected \(2, 1\)"):
        dequantize_fp8_block(q, s[:1], (128, 128))


def _write_config(d, quant=None):
    cfg = {"model_type": "deepseek_v32"}
    if quant is not None:
        cfg["quantization_config"] = quant
    (d / "config.json").write_text(json.dumps(cfg))


_FP8_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(40, 70, generator=g).to(torch.bfloat16),
        "a.norm.weight": torch.randn(70, generator=g),
        "b.weight": torch.randn(33, 16, generator=g).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
    }


def test_single_file_loading(tmp_path):
    t = _tensors()
    save_file(t, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path)
    out = load_checkpoint(tmp_path, dtype=None)
    assert out.keys() == t.keys()
    assert all(torch.equal(out[k], t[k]) and out[k].dtype == t[k].dtype for k in t)
    out = load_checkpoint(tmp_path, dtype=torch.float32)
    assert out["a.weight"].dtype == torch.float32 and out["ids"].dtype == torch.int64


def test_sharded_fp8_loading_with_scale_in_another_shard(tmp_path):
    t = _tensors()
    block = tuple(_FP8_CFG["weight_block_size"])
    qa, sa = quantize_fp8_block(t["a.weight"], block)
    qb, sb = quantize_fp8_block(t["b.weight"], block)
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": qa, "b.weight_scale_inv": sb, "ids": t["ids"]},
        "model-00002-of-00002.safetensors": {"a.weight_scale_inv": sa, "b.weight": qb, "a.norm.weight": t["a.norm.weight"]},
    }
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _write_config(tmp_path, _FP8_CFG)

    assert [p.name for p in checkpoint_files(tmp_path)] == sorted(shards)
    out = load_checkpoint(tmp_path, dtype=torch.float32)
    assert sorted(out) == sorted(t)
    for k in ("a.weight", "b.weight"):
        _assert_within_fp8_error(t[k].float(), out[k], {"a.weight": sa, "b.weight": sb}[k], block)
    assert torch.equal(out["a.norm.weight"], t["a.norm.weight"])

    raw = dict(iter_checkpoint_tensors(tmp_path, dtype=torch.bfloat16, dequantize=False))
    assert raw["a.weight"].dtype == torch.float8_e4m3fn and torch.equal(raw["a.weight"].float(), qa.float())
    assert raw["a.weight_scale_inv"].dtype == torch.float32 and torch.equal(raw["a.weight_scale_inv"], sa)


def test_unknown_quant_method_is_a_clear_error(tmp_path):
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    _write_config(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ConfigError, match=r"quantization_config.quant_method 'gptq' is not supported"):
        load_checkpoint(tmp_path)


def test_fp8_tensor_without_quantization_config(tmp_path):
    q, s = quantize_fp8_block(torch.randn(8, 8), (128, 128))
    save_file({"x.weight": q, "x.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path)
    with pytest.raises(ConfigError, match=r"'x.weight' is float8_e4m3fn but config.json has no fp8"):
        load_checkpoint(tmp_path)


def test_fp8_weight_without_scale(tmp_path):
    q, _ = quantize_fp8_block(torch.randn(8, 8), (16, 32))
    save_file({"x.weight": q}, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path, _FP8_CFG)
    with pytest.raises(ValueError, match=r"fp8 tensor 'x.weight' has no 'x.weight_scale_inv'"):
        load_checkpoint(tmp_path)


def test_no_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint"):
        load_checkpoint(tmp_path)


def test_is_fp8_quantizable_selection():
    w2 = torch.zeros(4, 4)
    yes = [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.indexer.wq_b.weight",
        "model.layers.0.self_attn.indexer.wk.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.4.mlp.experts.0.gate_proj.weight",
    ]
    no = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.indexer.weights_proj.weight",
        "model.layers.4.eh_proj.weight",
        "model.layers.4.shared_head.head.weight",
        "model.layers.4.embed_tokens.weight",
    ]
    assert all(is_fp8_quantizable(n, w2) for n in yes)
    assert not any(is_fp8_quantizable(n, w2) for n in no)
    assert not is_fp8_quantizable("model.layers.1.mlp.gate.e_score_correction_bias", torch.zeros(4))
    assert not is_fp8_quantizable("model.layers.0.self_attn.q_a_layernorm.weight", torch.zeros(4))


def test_write_fp8_checkpoint_of_tiny(tiny_dirs, tiny_fp8_dir):
    src = tiny_dirs["glm_moe_dsa"]
    ref = load_checkpoint(src, dtype=torch.float32)
    cfg = json.loads((tiny_fp8_dir / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }
    assert load_config(tiny_fp8_dir).weight_block_size == (128, 128)

    index = json.loads((tiny_fp8_dir / "model.safetensors.index.json").read_text())
    stored = {}
    for f in checkpoint_files(tiny_fp8_dir):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                assert index["weight_map"][k] == f.name
                stored[k] = h.get_slice(k).get_dtype()
    assert set(stored) == set(index["weight_map"])
    assert stored["model.layers.1.self_attn.kv_b_proj.weight"] == "F8_E4M3"
    assert stored["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"] == "F32"
    assert stored["model.layers.2.self_attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert stored["model.layers.4.mlp.experts.7.up_proj.weight"] == "F8_E4M3"
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.2.self_attn.indexer.weights_proj.weight", "model.layers.4.eh_proj.weight",
                 "model.layers.1.input_layernorm.weight"):
        assert stored[name] == "BF16", name
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"

    deq = load_checkpoint(tiny_fp8_dir, dtype=torch.float32)
    assert deq.keys() == ref.keys()
    for k, v in ref.items():
        if stored[k] == "F8_E4M3":
            err = (deq[k] - v).abs().max() / v.abs().max()
            assert err <= 2.0**-4, k
        else:
            assert torch.equal(deq[k], v), k
    # The tokenizer travels with the weights.
    assert (tiny_fp8_dir / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_write_fp8_refuses_fp8_source(tiny_fp8_dir, tmp_path):
    with pytest.raises(ValueError, match="already fp8-quantized"):
        write_fp8_checkpoint(tiny_fp8_dir, tmp_path / "again")
