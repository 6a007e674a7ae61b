"""The fused Triton noaux_tc routing (``models/ops/router_cuda.py``) against the torch `Router` (the spec).

* ``test_router_interpreter``: CPU tensors through Triton's interpreter (one subprocess with
  ``TRITON_INTERPRET=1``: this file run as a script), fresh random router weights, biases and tokens each
  run (``ROUTER_TEST_SEED`` replays one), at DeepSeek-V3.2's routing (256 experts, 8 groups, 4 kept, top 8)
  and small ones (16 experts in 1, 2 or 4 groups, with and without normalization): the same experts in the
  same order, the same weights to fp32 rounding. Ties are drawn on purpose: exact ties between experts
  and between groups go to the lower index (torch's order for them is unspecified, so those rows are
  checked against that rule, not torch).
* ``test_router_compiles_for_sm90``: the kernel compiles to an sm_90 cubin on the CPU.
* ``test_router_uses_the_fused_kernel_on_cuda_only``: CPU tensors and unsupported shapes keep torch.

On a GPU the cuda engine's tests run it at every MoE layer (teacher-forced against the reference, graph
replay == eager).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.triton_interpreter import compile_run, compile_sm90, compiled, kernel_suite, worker_main  # noqa: E402

SEED = int(os.environ.get("ROUTER_TEST_SEED", secrets.randbits(31)))


def _router(gen, E: int, G: int, TG: int, K: int, norm: bool, hidden: int = 64):
    from models.moe.router import Router

    cfg = SimpleNamespace(n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=TG,
                          norm_topk_prob=norm, routed_scaling_factor=2.5, hidden_size=hidden)
    r = Router(cfg)
    r.weight.data.copy_(torch.randn(E, hidden, generator=gen) * 0.2)
    r.e_score_correction_bias.data.copy_(torch.randn(E, generator=gen) * 0.05)
    return r


def _fused(r, x):
    from models.ops import router_cuda as k

    logits = torch.nn.functional.linear(x.float(), r.weight.float())
    return k.route(logits, r.e_score_correction_bias.float(), r.n_group, r.topk_group, r.top_k,
                   r.norm_topk_prob, r.scaling)


def check_against_torch(gen) -> None:
    for E, G, TG, K, norm in ((256, 8, 4, 8, True), (16, 4, 2, 4, True), (16, 2, 1, 3, False), (16, 1, 1, 8, True)):
        r = _router(gen, E, G, TG, K, norm)
        x = torch.randn(37, 64, generator=gen)
        w, ids = _fused(r, x)
        want_w, want_ids = r(x)  # CPU: the torch spec
        assert ids.dtype == torch.int64 and w.dtype == torch.float32
        assert torch.equal(ids, want_ids), (E, G, (ids != want_ids).nonzero()[:4].tolist())
        torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7)


def check_ties_go_to_the_lower_index(gen) -> None:
    from models.ops import router_cuda as k

    # Experts 3 and 5 tie for the best score, and groups 0 and 1 tie for the best group (experts 0-7, 8-15).
    logits = torch.full((1, 16), -4.0)
    logits[0, [3, 5, 11, 13]] = 2.0
    w, ids = k.route(logits, torch.zeros(16), 2, 1, 2, True, 1.0)
    assert ids.tolist() == [[3, 5]], ids  # group 0 kept (the lower of the tied groups), expert 3 first
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5]]))
    empty_w, empty_ids = k.route(torch.empty(0, 16), torch.zeros(16), 2, 1, 2, True, 1.0)
    assert empty_w.shape == (0, 2) and empty_ids.shape == (0, 2)


CHECKS = {"against_torch": check_against_torch, "ties": check_ties_go_to_the_lower_index}

PRESTART, interpreter_results, test_router_interpreter = kernel_suite(
    __file__, SEED, CHECKS, "ROUTER_TEST_SEED", "test_router_compiles_for_sm90")
"""The subprocesses this module reads, started early (tests/prestart.py); the interpreter checks' fixture and test."""


def _compile_worker() -> None:
    from models.ops import router_cuda as k

    sig = dict(logits_ptr="*fp32", logits_stride="i64", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64",
               scaling="fp32")
    for E, G, TG, K in ((256, 8, 4, 8), (16, 1, 1, 8)):
        consts = dict(E=E, G=G, TOPK_GROUP=TG, K=K, BLOCK_K=1 << (K - 1).bit_length(), NORM=True)
        compile_sm90(k._route_kernel, sig, consts, num_warps=4 if E >= 256 else 1)


def test_router_compiles_for_sm90():
    compiled(compile_run(__file__))


def test_router_uses_the_fused_kernel_on_cuda_only():
    from models.ops import router_cuda as k

    assert k.supports(256, 8, 4, 8) and k.supports(16, 1, 1, 8)
    assert not k.supports(160, 8, 4, 8) and not k.supports(16, 3, 1, 2) and not k.supports(16, 4, 1, 8)
    r = _router(torch.Generator().manual_seed(0), 16, 4, 2, 4, True)
    x = torch.randn(5, 64)
    w, ids = r(x)  # CPU tensors: the torch path, whatever Triton can do
    assert w.shape == ids.shape == (5, 4)


if __name__ == "__main__":
    worker_main(sys.argv[1:], CHECKS, _compile_worker)
