"""The cuda backend on an fp8 checkpoint held in fp8 (`models.fp8`) against the reference backend,
which dequantizes it on load: teacher-forced logits, as tests/attention/test_cuda_backend.py does for
bf16 checkpoints, within the same tolerances, plus the weights really being fp8 on the GPU.

Run with the weight-only fp8 GEMMs at every size (``DEEPGEMM_MIN_M`` raised): DeepGEMM's W8A8
products quantize the activations too (~2.6% relative per GEMM, the fp8 error of dynamic 1 x 128
activation scales, which the checkpoint's ``activation_scheme: dynamic`` declares), and in a random
untrained model that noise flips indexer top-k selections and compounds (H200, 2026-11-27:
logits 0.55-0.69 rel L2 from the dequantized twin after one 260-token prefill, while the first
GEMM of the first layer sits at 0.026, `bench/fp8_layer_diff.py`). DeepGEMM itself is held to
its W8A8 spec in test_fp8_kernels.py.

The tiny models have the serving attention dims and 256-wide hidden / 128-wide experts, so that
every projection and expert holds whole 128 x 128 fp8 blocks (the fp8 experts need that).
"""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_cuda_backend import (
    E2E_MAX_REL_TOL,
    E2E_MEDIAN_REL_TOL,
    E2E_MIN_AGREEMENT,
    REAL_DIMS,
    compare_backends,
)

pytestmark = pytest.mark.gpu

FP8_DIMS = dict(REAL_DIMS, hidden_size=256, moe_intermediate_size=128, intermediate_size=512)


def make_fp8_tiny(arch: str, out):
    from models.tiny import make_tiny

    return make_tiny(arch, out, seed=5, fp8=True, **FP8_DIMS)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_fp8_real_dims")
    return {arch: make_fp8_tiny(arch, root / arch) for arch in ("deepseek_v32", "glm_moe_dsa")}


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_llm_cuda_matches_reference_gpu(arch, fp8_models, monkeypatch):
    from models.ops import fp8_linear_cuda

    monkeypatch.setattr(fp8_linear_cuda, "DEEPGEMM_MIN_M", 1 << 30)
    r = compare_backends(fp8_models[arch], "bfloat16")
    llm = r["cuda_llm"]
    dtypes = {n: p.dtype for n, p in llm.model.named_parameters()}
    assert dtypes["layers.1.mlp.experts.w13"] == torch.float8_e4m3fn
    assert dtypes["layers.1.self_attn.q_a_proj.weight"] == torch.float8_e4m3fn
    worst = max(s["rel_err"] for s in r["steps"])
    median = sorted(s["rel_err"] for s in r["steps"])[len(r["steps"]) // 2]
    flips = [s for s in r["steps"] if not s["agree"]]
    agreement = 1 - len(flips) / len(r["steps"])
    print(f"E2E fp8 {arch}: greedy_equal={r['greedy_equal']} first_divergence={r['first_divergence']} "
          f"max_rel_err={worst:.3e} median_rel_err={median:.3e} argmax_agreement={agreement:.3f} "
          f"flip_margins={[round(s['margin'], 4) for s in flips]}")
    assert worst <= E2E_MAX_REL_TOL and median <= E2E_MEDIAN_REL_TOL and agreement >= E2E_MIN_AGREEMENT
