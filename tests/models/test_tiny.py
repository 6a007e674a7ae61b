"""models.tiny: the tiny checkpoints load in transformers, carry MTP weights, and are reproducible."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from models.config import load_config
from models.tiny import make_tiny
from models.weights import checkpoint_files, load_checkpoint

ARCHS = ("deepseek_v32", "glm_moe_dsa")


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for arch, d in tiny_dirs.items()
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_main_weight(arch, tiny_dirs, hf_models):
    model = hf_models[arch]
    assert type(model).__name__ == {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[arch]
    ours = load_checkpoint(tiny_dirs[arch], dtype=torch.float32)
    theirs = model.state_dict()
    # transformers fuses experts; compare everything else name by name.
    compared = 0
    for name, t in theirs.items():
        if name in ours:
            assert torch.equal(ours[name], t.float()), name
            compared += 1
    assert compared > 40
    # Weights must not sit at init constants: a loader that skipped them would go unnoticed.
    assert not torch.allclose(ours["model.norm.weight"], torch.ones(64))
    assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_not_flat_and_indexer_really_sparse(arch, hf_models):
    model = hf_models[arch]
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sparse = model(ids).logits
    assert sparse.std() > 0.5
    margins = sparse[0, :, :256].topk(2, dim=-1).values
    assert (margins[:, 0] - margins[:, 1]).median() > 0.05
    # With index_topk 16 < 48 tokens the indexer must change the result.
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    assert indexers
    try:
        for m in indexers:
            m.index_topk = 4096
        with torch.no_grad():
            dense = model(ids).logits
    finally:
        for m in indexers:
            m.index_topk = 16
    assert torch.allclose(sparse[0, :16], dense[0, :16], atol=1e-5)
    assert not torch.allclose(sparse[0, 16:], dense[0, 16:], atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_layer_weights(arch, tiny_dirs):
    d = tiny_dirs[arch]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    on_disk = {}
    for f in checkpoint_files(d):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                on_disk[k] = f.name
    assert on_disk == index["weight_map"]
    assert len(set(on_disk.values())) == 2
    assert all(v == "model-00002-of-00002.safetensors" for k, v in on_disk.items() if k.startswith(f"model.layers.{L}."))

    w = load_checkpoint(d, dtype=torch.float32)
    p = f"model.layers.{L}."
    assert w[p + "eh_proj.weight"].shape == (H, 2 * H)
    assert w[p + "enorm.weight"].shape == w[p + "hnorm.weight"].shape == w[p + "shared_head.norm.weight"].shape == (H,)
    assert torch.equal(w[p + "shared_head.head.weight"], w["lm_head.weight"])
    assert torch.equal(w[p + "embed_tokens.weight"], w["model.embed_tokens.weight"])
    assert w[p + "shared_head.head.weight"].shape == (V, H)
    # A full MoE decoder layer with its own indexer.
    cfg_obj = load_config(d)
    for suffix in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight", "self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight",
        "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias", "self_attn.indexer.weights_proj.weight",
        "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
    ):
        assert p + suffix in w, suffix
    for e in range(cfg_obj.n_routed_experts):
        assert w[p + f"mlp.experts.{e}.gate_proj.weight"].shape == (cfg_obj.moe_intermediate_size, H)
        assert w[p + f"mlp.experts.{e}.down_proj.weight"].shape == (H, cfg_obj.moe_intermediate_size)
    assert w[p + "self_attn.kv_a_proj_with_mqa.weight"].shape == (cfg_obj.kv_cache_dim, H)
    # Its weights are its own, not a copy of a main layer.
    assert not torch.equal(w[p + "self_attn.q_a_proj.weight"], w["model.layers.3.self_attn.q_a_proj.weight"])


def test_glm_shared_layers_have_no_indexer(tiny_dirs):
    cfg = load_config(tiny_dirs["glm_moe_dsa"])
    w = load_checkpoint(tiny_dirs["glm_moe_dsa"], dtype=torch.float32)
    for layer, computes in enumerate(cfg.topk_plan.computes):
        assert (f"model.layers.{layer}.self_attn.indexer.wk.weight" in w) == computes


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_roundtrip_and_ids(arch, tiny_dirs):
    from transformers import AutoTokenizer

    d = tiny_dirs[arch]
    tok = AutoTokenizer.from_pretrained(d)
    cfg = load_config(d)
    assert tok.bos_token_id == cfg.bos_token_id == 256
    assert cfg.eos_token_ids == (tok.eos_token_id,) == (257,)
    assert len(tok) == 261 <= cfg.vocab_size
    for text in ("hello world", "héllo wörld — ✓ 🙂 日本語", "  leading\tand\ntrailing  ", ""):
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id
        assert ids[1:] == list(text.encode("utf-8"))
        assert tok.decode(ids, skip_special_tokens=True) == text
    ids = tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>", "<|system|>"])
    assert ids == [258, 259, 260]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>be brief<|user|>hi<|assistant|>"
    chat_ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert chat_ids == [256, 260, *b"be brief", 258, *b"hi", 259]


def test_same_seed_byte_identical_other_seed_differs(tmp_path, tiny_dirs):
    a = make_tiny("glm_moe_dsa", tmp_path / "a", seed=0)
    b = tiny_dirs["glm_moe_dsa"]
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = make_tiny("glm_moe_dsa", tmp_path / "c", seed=1)
    wa, wc = load_checkpoint(a, dtype=torch.float32), load_checkpoint(c, dtype=torch.float32)
    assert not torch.equal(wa["model.layers.1.self_attn.q_b_proj.weight"], wc["model.layers.1.self_attn.q_b_proj.weight"])
    assert not torch.equal(wa["model.layers.4.eh_proj.weight"], wc["model.layers.4.eh_proj.weight"])


def test_fp8_byte_identical_and_overrides(tmp_path, tiny_fp8_dir):
    a = make_tiny("glm_moe_dsa", tmp_path / "a", seed=0, fp8=True)
    for p in a.iterdir():
        assert p.read_bytes() == (tiny_fp8_dir / p.name).read_bytes(), p.name
    # Overrides: no MTP layer gives a single-file checkpoint; the plan follows num_hidden_layers.
    d = make_tiny("glm_moe_dsa", tmp_path / "nomtp", num_nextn_predict_layers=0, num_hidden_layers=6,
                  index_skip_topk_offset=3)
    assert [p.name for p in checkpoint_files(d)] == ["model.safetensors"]
    cfg = load_config(d)
    assert cfg.num_layers_with_mtp == 6
    assert cfg.topk_plan.computes == (True, True, True, False, True, False)


def test_v32_fp8_small_blocks(tmp_path):
    d = make_tiny("deepseek_v32", tmp_path / "v", fp8=True, fp8_block=(16, 32))
    cfg = load_config(d)
    assert cfg.weight_block_size == (16, 32)
    with safe_open(str(checkpoint_files(d)[0]), "pt") as h:
        # kv_b_proj [8 heads * (16 + 16), 32] -> scale [256/16, 32/32]
        assert h.get_slice("model.layers.1.self_attn.kv_b_proj.weight_scale_inv").get_shape() == [16, 1]
    with safe_open(str(checkpoint_files(d)[1]), "pt") as h:
        assert h.get_slice("model.layers.4.mlp.experts.0.down_proj.weight").get_dtype() == "F8_E4M3"
        assert h.get_slice("model.layers.4.eh_proj.weight").get_dtype() == "BF16"


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match=r"arch must be one of .* got 'llama'"):
        make_tiny("llama", tmp_path)
