"""The Triton routed-experts MoE on the GPU at DeepSeek-V3.2 dims.

H = 7168, I = 2048, 256 experts, top-8 (8 groups, 4 compete), one shared
expert, bf16 activations, bf16 and fp8 (128 x 128 blocks) weights. Against the torch reference grouped GEMM (a per-expert loop):

* grouped GEMMs (masked and contiguous layouts) at T in {1, 32, 128} with
  random, hot (one expert in every token) and one-group (8 experts take every
  token, 248 get none) routing, and an expert-parallel half; the weights of
  experts no token chose are NaN, so reading them into any output fails;
* the whole layer under ``static_shapes`` captured in a CUDA graph: replays on
  fresh inputs equal the eager static step bit for bit, and the eager
  contiguous layer and the reference within bf16 tolerance.

Random inputs with a fresh seed per run (``MOE_TEST_SEED`` replays one).
"""

from __future__ import annotations

import os
import secrets
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("MOE_TEST_SEED", secrets.randbits(31)))
H, I, E, K = 7168, 2048, 256, 8
TOKENS = (1, 32, 128)


def _close(got: torch.Tensor, want: torch.Tensor, label: str, tol: float = 2e-2) -> None:
    """bf16 tolerance, relative to the largest magnitude (a few outputs sit near zero)."""
    got, want = got.float(), want.float()
    scale = float(want.abs().max()) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    rel = float((got - want).norm() / want.norm().clamp(min=1e-30)) if want.numel() else 0.0
    print(f"{label}: max |err| {err:.3e} (max |want| {scale:.3e}), relative L2 {rel:.2e}")
    assert err <= tol * scale and rel <= tol, label


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def moe(request):
    """The MoE layer with random weights; ``fp8``: routed and shared experts block-quantized (128 x 128)."""
    pytest.importorskip("triton")
    from models.moe.layer import MoE
    from models.parallel import SINGLE
    from models.weights import quantize_fp8_block

    cfg = SimpleNamespace(n_routed_experts=E, num_experts_per_tok=K, n_group=8, topk_group=4, norm_topk_prob=True,
                          routed_scaling_factor=2.5, hidden_size=H, moe_intermediate_size=I, n_shared_experts=1)
    fp8 = request.param == "fp8"
    with torch.device("meta"):
        layer = MoE(cfg, SINGLE, torch.bfloat16)
        if fp8:
            layer.experts.to_fp8((128, 128))
            for lin in (layer.shared_experts.gate_proj, layer.shared_experts.up_proj, layer.shared_experts.down_proj):
                lin.to_fp8((128, 128))
    layer = layer.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("_scale_inv"):
                continue  # filled with their weights below
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.01, generator=gen)
            elif p.dtype == torch.float8_e4m3fn:
                owner = layer.get_submodule(name.rsplit(".", 1)[0])
                scale = getattr(owner, name.rsplit(".", 1)[1] + "_scale_inv")
                for i in range(p.shape[0] if p.dim() == 3 else 1):
                    w = torch.empty(p.shape[-2:], device="cuda").normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
                    q, s = quantize_fp8_block(w, (128, 128))
                    (p[i] if p.dim() == 3 else p).copy_(q)
                    (scale[i] if p.dim() == 3 else scale).copy_(s)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    print(f"MOE_TEST_SEED={SEED} weights {request.param}")
    return layer.eval()


def _ids(T: int, kind: str, gen) -> torch.Tensor:
    if kind == "one_group":
        return torch.arange(E - K, E, device="cuda").repeat(T, 1)
    ids = torch.rand(T, E, generator=gen, device="cuda").argsort(dim=1)[:, :K]
    if kind == "hot":  # expert 3 in every token
        has = (ids == 3).any(1)
        ids[~has, 0] = 3
    return ids


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("kind,ranks", [("random", (0, E)), ("hot", (0, E)), ("one_group", (0, E)),
                                        ("random", (E // 2, E // 2))])
def test_grouped_gemm_equals_reference_gpu(moe, T, kind, ranks):
    from models.moe import dispatch
    from models.ops import grouped_gemm_cuda as cu
    from models.ops import grouped_gemm_ref as ref

    gen = torch.Generator(device="cuda").manual_seed(SEED + T)
    first, n_local = ranks
    ex = moe.experts
    w13, w2 = ex.w13.data[first:first + n_local], ex.w2.data[first:first + n_local]
    # fp8: the unused experts' scales are poisoned instead (NaN is no fp8 e4m3fn value worth relying on).
    p13, p2 = (ex.w13_scale_inv.data[first:first + n_local], ex.w2_scale_inv.data[first:first + n_local]) \
        if ex.quant_block else (w13, w2)
    scales = dict(w13_scale=p13, w2_scale=p2, block=ex.quant_block) if ex.quant_block else {}
    ids = _ids(T, kind, gen)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    wts = torch.rand(T, K, generator=gen, device="cuda")
    unused = sorted(set(range(first, first + n_local)) - set(ids.flatten().tolist()))
    idx = torch.tensor([e - first for e in unused], device="cuda", dtype=torch.long)
    saved = (p13[idx].clone(), p2[idx].clone())
    p13[idx] = float("nan")
    p2[idx] = float("nan")
    try:
        for make in (dispatch.masked_layout, dispatch.contiguous_layout):
            layout = make(ids, first, n_local, E)
            label = f"T={T} {kind} experts [{first}, {first + n_local}) {make.__name__}"
            mine = layout.local_pairs().flatten()
            y = cu.expert_outputs(x, w13, w2, layout, **scales)
            y_ref = ref.expert_outputs(x, w13, w2, layout, **scales)
            assert torch.isfinite(y[mine]).all(), label
            _close(y[mine], y_ref[mine], label)
            _close(cu.combine(y, wts, layout), ref.combine(y_ref, wts, layout), label + " combined")
    finally:
        p13[idx], p2[idx] = saved


@pytest.mark.parametrize("T", TOKENS)
def test_masked_moe_graph_replay_equals_eager_gpu(moe, T):
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1000 + T)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            moe(x, static_shapes=True, kernels="cuda")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x, static_shapes=True, kernels="cuda")
        for trial in range(3):
            x.copy_(torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16))
            graph.replay()
            eager = moe(x, static_shapes=True, kernels="cuda")
            assert torch.equal(out, eager), f"T={T} replay {trial}: {float((out.float() - eager.float()).abs().max())}"
            _close(moe(x, kernels="cuda"), eager, f"T={T} contiguous vs masked")
            _close(moe(x, kernels="reference"), eager, f"T={T} reference vs triton")
