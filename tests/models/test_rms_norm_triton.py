"""The fused Triton RMSNorm (``models/ops/rms_norm_cuda.py``) against the torch module (the spec).

* ``test_rms_norm_interpreter``: CPU tensors through Triton's interpreter, in one subprocess with
  ``TRITON_INTERPRET=1`` (this file run as a script), fp32 and fp16 (the interpreter misreads bf16),
  fresh random inputs each run (``NORM_TEST_SEED`` replays one): plain rows, 3-D input, a strided
  slice (MLA's ``kv[:, :rank]``), residual add + norm, zero rows.
* ``test_rms_norm_compiles_for_sm90``: the kernel compiles to an sm_90 cubin on the CPU for bf16 at
  the DeepSeek-V3.2 norm widths, with and without the residual.
* ``test_modules_use_the_fused_kernel_on_cuda_only``: CPU tensors keep the torch path.

On a GPU the cuda engine's tests (teacher-forced against the reference, graph replay == eager) run
it compiled at every norm of the model.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.triton_interpreter import compile_run, compiled, kernel_suite, worker_main  # noqa: E402

SEED = int(os.environ.get("NORM_TEST_SEED", secrets.randbits(31)))


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from models.norms import RMSNorm

    norm = RMSNorm(x.shape[-1], eps, dtype=x.dtype)
    norm.weight.data.copy_(w)
    return norm(x)  # CPU tensors: the torch path


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal to float32 rounding; fp16: within one unit in the last place, and rarely off."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    diff = (got.float() - want.float()).abs()
    ulp = torch.finfo(got.dtype).eps * want.float().abs().clamp_min(torch.finfo(got.dtype).tiny)
    assert bool((diff <= 2 * ulp + 1e-7).all()), float((diff / (ulp + 1e-30)).max())
    assert float((diff > 0).float().mean()) < 0.02


def _inputs(gen, rows: int, n: int, dtype: torch.dtype, scale: float = 3.0):
    x = (torch.randn(rows, n, generator=gen) * scale).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype)
    return x, w


def check_plain(gen) -> None:
    from models.ops import rms_norm_cuda as k

    for dtype in (torch.float32, torch.float16):
        for rows, n in ((1, 7168), (5, 1536), (3, 512), (7, 100)):
            x, w = _inputs(gen, rows, n, dtype)
            _close(k.rms_norm(x, w, 1e-6), _reference(x, w, 1e-6))


def check_shapes_and_strides(gen) -> None:
    from models.ops import rms_norm_cuda as k

    for dtype in (torch.float32, torch.float16):
        x, w = _inputs(gen, 6, 64, dtype)
        x3 = x.view(2, 3, 64)
        _close(k.rms_norm(x3, w, 1e-5), _reference(x3, w, 1e-5))
        wide = (torch.randn(4, 576, generator=gen) * 2).to(dtype)  # MLA's kv = [latent 512 | rope 64]
        latent = wide[:, :512]
        assert latent.stride(0) == 576 and k.supports(latent, w.new_ones(512))
        w512 = (1 + 0.1 * torch.randn(512, generator=gen)).to(dtype)
        _close(k.rms_norm(latent, w512, 1e-6), _reference(latent.contiguous(), w512, 1e-6))
        empty = torch.empty(0, 64, dtype=dtype)
        assert k.rms_norm(empty, w, 1e-6).shape == (0, 64)


def check_residual(gen) -> None:
    from models.ops import rms_norm_cuda as k

    for dtype in (torch.float32, torch.float16):
        for rows, n in ((1, 7168), (9, 256)):
            x, w = _inputs(gen, rows, n, dtype)
            delta = (torch.randn(rows, n, generator=gen) * 0.7).to(dtype)
            total, normed = k.rms_norm(x, w, 1e-6, residual=delta)
            assert torch.equal(total, x + delta)  # rounded to the dtype as torch's add rounds
            _close(normed, _reference(x + delta, w, 1e-6))


CHECKS = {"plain": check_plain, "shapes_and_strides": check_shapes_and_strides, "residual": check_residual}

PRESTART, interpreter_results, test_rms_norm_interpreter = kernel_suite(__file__, SEED, CHECKS, "NORM_TEST_SEED", "test_rms_norm_compiles_for_sm90")
"""The subprocesses this module reads, started early (tests/prestart.py); the interpreter checks' fixture and test."""


def _compile_worker() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.ops import rms_norm_cuda as k

    sig = dict(x_ptr="*bf16", x_stride="i64", res_ptr="*bf16", res_stride="i64", w_ptr="*bf16", out_ptr="*bf16",
               out_stride="i64", sum_ptr="*bf16", sum_stride="i64", N="i32", eps="fp32")
    for n in (7168, 1536, 512):  # hidden, q_lora_rank, kv_lora_rank
        block = triton.next_power_of_2(n)
        for has_res in (False, True):
            consts = dict(HAS_RES=has_res, BLOCK=block)
            src = ASTSource(fn=k._rms_norm_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                            constexprs=consts)
            triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=min(16, max(1, block // 512))))


def test_rms_norm_compiles_for_sm90():
    compiled(compile_run(__file__))


def test_modules_use_the_fused_kernel_on_cuda_only():
    from models.norms import RMSNorm

    norm = RMSNorm(8, dtype=torch.float32)
    x = torch.randn(3, 8)
    assert norm._fused(x) is None  # CPU: the torch spec
    total, h = norm.add_and_norm(x, torch.ones(3, 8))
    assert torch.equal(total, x + 1) and torch.equal(h, norm(x + 1))


if __name__ == "__main__":
    worker_main(sys.argv[1:], CHECKS, _compile_worker)
