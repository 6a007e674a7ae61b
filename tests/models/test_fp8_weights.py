"""fp8 block-quantized weights kept in fp8 (`models.fp8`, `ReplicatedLinear.to_fp8`, the loader's
``fp8_weights``) and the memory plan counted on the meta-device model (`models.footprint`).

On CPU the fp8 modules run the reference GEMMs (dequantize, then ``F.linear``): a model holding an
fp8 checkpoint in fp8 must compute exactly what the model that dequantized it on load computes. The
fast kernels are checked against those references in test_fp8_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from attention.backend import get_backend
from attention.cache import PagedKVCache
from deployments.controller import weight_bytes_per_rank
from models import fp8, footprint
from models.batch import ForwardMode
from models.config import load_config
from models.loader import load_model, module_name
from models.tiny import make_tiny
from models.weights import iter_checkpoint_tensors
from workers.model_runner import ModelRunner, WorkItem
from workers.rank_build import RankSpec

PROMPT = (5, 17, 2, 99, 41, 7, 7, 300, 12, 64, 1, 250, 33, 8, 90, 111, 3, 45, 60, 71)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """{arch: tiny checkpoint with 16 x 16 fp8 blocks} (several blocks per projection, partial edges)."""
    root = tmp_path_factory.mktemp("fp8w")
    return {arch: make_tiny(arch, root / arch, seed=3, fp8=True, fp8_block=(16, 16))
            for arch in ("deepseek_v32", "glm_moe_dsa")}


def _prompt_logits(model) -> torch.Tensor:
    spec = RankSpec("unused", num_pages=8)
    cache = PagedKVCache(spec.cache_spec(model.cfg), "cpu")
    runner = ModelRunner(model, cache, get_backend("reference"), "cpu")
    _, hidden = runner.forward(ForwardMode.PREFILL, [WorkItem(PROMPT, 0, (0, 1))])
    with torch.inference_mode():
        return model.logits(hidden)


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_kept_equals_dequantized_on_load(arch, fp8_dirs):
    d = fp8_dirs[arch]
    deq = load_model(d, torch.float32)
    kept = load_model(d, torch.float32, fp8_weights=True)
    attn = kept.layers[1].self_attn
    assert attn.q_a_proj.weight.dtype == attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.q_a_proj.weight_scale_inv.shape == (48 // 16, 64 // 16)
    assert kept.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert kept.mtp[0].decoder.mlp.experts.w2.dtype == torch.float8_e4m3fn
    # Read outside a GEMM: dequantized even here. Not in the checkpoint's fp8 set: high precision.
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.quant_block is None
    assert kept.layers[1].mlp.gate.weight.dtype == torch.float32
    assert kept.lm_head.weight.dtype == torch.float32
    assert torch.equal(_prompt_logits(kept), _prompt_logits(deq))


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_planned_fp8_modules_are_the_checkpoints(arch, fp8_dirs):
    d = fp8_dirs[arch]
    cfg = load_config(d)
    model = footprint.meta_model(cfg)
    found = fp8.checkpoint_fp8_modules(model, d, lambda n: module_name(n, cfg), cfg.weight_block_size)
    assert found == fp8.planned_fp8_modules(model, cfg.weight_block_size)
    assert "layers.1.mlp.experts" in found and "layers.0.self_attn.kv_b_proj" not in found


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("fp8_weights,with_mtp,hadamard", [(True, True, False), (True, False, True),
                                                           (False, True, False)])
def test_memory_plan_is_what_loading_allocates(arch, fp8_dirs, fp8_weights, with_mtp, hadamard):
    d = fp8_dirs[arch]
    model = load_model(d, torch.bfloat16, fp8_weights=fp8_weights, with_mtp=with_mtp, hadamard=hadamard)
    planned = weight_bytes_per_rank(load_config(d), 1, dtype="bfloat16", fp8_weights=fp8_weights,
                                    with_mtp=with_mtp, hadamard=hadamard)
    assert planned == fp8.weight_bytes(model)


def test_fp8_plan_is_about_half_of_bf16(fp8_dirs):
    cfg = load_config(fp8_dirs["deepseek_v32"])
    kept = footprint.weight_bytes(cfg, 1, torch.bfloat16, fp8_weights=True, with_mtp=True)
    deq = footprint.weight_bytes(cfg, 1, torch.bfloat16, fp8_weights=False, with_mtp=True)
    assert kept < deq  # the tiny model is dominated by its embeddings: no sharper bound here


def test_experts_narrower_than_a_block_are_dequantized(tiny_fp8_dir):
    """The shared tiny fp8 checkpoint has 128 x 128 blocks and 32-wide experts: its experts cannot be
    stacked in fp8 (gate and up would share scale rows), so they load dequantized, and the plan agrees."""
    kept = load_model(tiny_fp8_dir, torch.bfloat16, fp8_weights=True)
    assert kept.layers[1].mlp.experts.w13.dtype == torch.bfloat16
    assert kept.layers[1].self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    planned = weight_bytes_per_rank(load_config(tiny_fp8_dir), 1, dtype="bfloat16", fp8_weights=True,
                                    with_mtp=True)
    assert planned == fp8.weight_bytes(kept)


def test_iter_checkpoint_tensors_dequantizes_per_weight(fp8_dirs):
    d = fp8_dirs["deepseek_v32"]
    keep = "model.layers.1.self_attn.q_a_proj.weight"
    got = dict(iter_checkpoint_tensors(d, dtype=torch.float32, dequantize=lambda n: n != keep))
    assert got[keep].dtype == torch.float8_e4m3fn and keep + "_scale_inv" in got
    other = "model.layers.1.self_attn.o_proj.weight"
    assert got[other].dtype == torch.float32 and other + "_scale_inv" not in got
