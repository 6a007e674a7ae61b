"""Same-input projections stacked into one GEMM (`models.fused_projections`) against the separate ones (the
spec): each part's output, an fp8 checkpoint's block scales, what cannot be stacked, and whole models (prompt
logits and greedy output, V3.2 with MTP and GLM-5 with its shared top-k layers) after `fuse_projections`."""

from __future__ import annotations

import copy

import pytest
import torch

from models.fused_projections import StackedLinear, fuse_projections, stack
from models.parallel import ReplicatedLinear
from tests.workers.prompts import random_prompt
from workers.offline import LLM


def _linear(gen, n_in, n_out, dtype=torch.float32, bias=False):
    m = ReplicatedLinear(n_in, n_out, bias=bias, dtype=dtype)
    m.weight.data.copy_(torch.randn(n_out, n_in, generator=gen).to(dtype))
    return m


def test_stacked_parts_equal_the_separate_projections():
    gen = torch.Generator().manual_seed(0)
    parts = [_linear(gen, 96, n) for n in (48, 16, 36)]
    s = stack(parts)
    assert isinstance(s, StackedLinear) and s.parts == (48, 16, 36)
    x = torch.randn(7, 96, generator=gen)
    for got, m in zip(s(x), parts):
        torch.testing.assert_close(got, m(x), rtol=1e-6, atol=1e-6)


def test_fp8_parts_keep_their_block_scales():
    gen = torch.Generator().manual_seed(1)
    block = (16, 16)
    parts = []
    for n_out in (32, 16, 24):  # the last part may end mid-block
        m = ReplicatedLinear(48, n_out, dtype=torch.float32)
        m.to_fp8(block)
        m.weight.data.copy_((torch.randn(n_out, 48, generator=gen) * 0.5).to(torch.float8_e4m3fn))
        m.weight_scale_inv.data.copy_(torch.rand(m.weight_scale_inv.shape, generator=gen) + 0.5)
        parts.append(m)
    s = stack(parts)
    assert s is not None and s.quant_block == block and s.weight.dtype == torch.float8_e4m3fn
    assert s.weight_scale_inv.shape == (2 + 1 + 2, 3)
    x = torch.randn(5, 48, generator=gen)
    for got, m in zip(s(x), parts):
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
    # A part that does not end on a block boundary before another: its scales could not be concatenated.
    misaligned = ReplicatedLinear(48, 24, dtype=torch.float32)
    misaligned.to_fp8(block)
    assert stack([misaligned, parts[0]]) is None


def test_what_cannot_be_stacked_is_left_alone():
    gen = torch.Generator().manual_seed(2)
    assert stack([_linear(gen, 32, 8), _linear(gen, 32, 8, bias=True)]) is None
    assert stack([_linear(gen, 32, 8), _linear(gen, 16, 8)]) is None
    assert stack([_linear(gen, 32, 8), _linear(gen, 32, 8, dtype=torch.float64)]) is None


@pytest.mark.parametrize("arch,k", [("deepseek_v32", 2), ("glm_moe_dsa", 0)])
def test_fused_model_equals_the_separate_projections(arch, k, tmp_path):
    from tests.workers.mtp_friendly import make_mtp_friendly

    model_dir = make_mtp_friendly(arch, tmp_path / arch)
    prompts = [random_prompt(n, 300, 60 + n) for n in (5, 70, 131)]
    plain = LLM(model_dir, mtp_draft_tokens=k, chunk_size=64)
    want_logits = [plain.prompt_logits(p) for p in prompts]
    want = plain.generate(prompts, max_new_tokens=6, ignore_eos=True)

    fused = LLM(model_dir, mtp_draft_tokens=k, chunk_size=64)
    before = sum(p.numel() for p in fused.model.parameters())
    layers = fuse_projections(fused.model)
    assert layers == len([m for m in fused.model.modules() if type(m).__name__ == "MLAttention"]) > 0
    assert sum(p.numel() for p in fused.model.parameters()) == before  # moved, not copied
    attn = fused.model.layers[0].self_attn
    assert attn.q_a_proj is None and attn.x_proj is not None
    if arch == "glm_moe_dsa":  # a layer reusing an earlier top-k has no indexer: q_a | kv_a only
        shared = [m.self_attn for m in fused.model.layers if m.self_attn.indexer is None]
        assert shared and all(len(a.x_proj.parts) == 2 and a.q_proj is None for a in shared)
    for p, w in zip(prompts, want_logits):
        torch.testing.assert_close(fused.prompt_logits(p), w, rtol=1e-4, atol=1e-4)
    assert fused.generate(prompts, max_new_tokens=6, ignore_eos=True) == want
    assert fuse_projections(fused.model) == 0  # idempotent


def test_tensor_parallel_keeps_the_column_sharded_query_apart(tmp_path):
    from models.tiny import make_tiny

    model_dir = make_tiny("deepseek_v32", tmp_path / "v32")
    llm = LLM(model_dir, chunk_size=64)
    model = copy.deepcopy(llm.model)
    fuse_projections(model, tp_size=2)
    attn = model.layers[0].self_attn
    assert attn.x_proj is not None and attn.q_proj is None and attn.q_b_proj is not None


def test_a_key_projection_stored_otherwise_stays_apart(tmp_path):
    """fp8 q_a / kv_a beside a bf16 indexer key projection: q_a | kv_a are stacked, wk keeps its own GEMM."""
    from models.mla import MLAttention

    gen = torch.Generator().manual_seed(3)
    attn = MLAttention.__new__(MLAttention)
    torch.nn.Module.__init__(attn)
    attn.q_a_proj, attn.kv_a_proj_with_mqa = _linear(gen, 32, 16), _linear(gen, 32, 8)
    attn.q_b_proj = _linear(gen, 16, 24)
    attn.indexer = torch.nn.Module()
    attn.indexer.wk, attn.indexer.wq_b = _linear(gen, 32, 4, dtype=torch.float64), _linear(gen, 16, 8)
    attn.x_proj = attn.q_proj = None
    assert fuse_projections(attn) == 1
    assert attn.x_proj.parts == (16, 8) and attn.indexer.wk is not None and attn.q_proj.parts == (24, 8)
