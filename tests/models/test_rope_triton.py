"""The fused Triton rotary embedding (``models/ops/rope_cuda.py``) against `models.rope.apply_rope`.

* ``test_rope_interpreter``: CPU tensors through Triton's interpreter (this file run as a script with
  ``TRITON_INTERPRET=1``), fp32 and fp16 (the interpreter misreads bf16), fresh random inputs each run
  (``ROPE_TEST_SEED`` replays one): MLA's strided query and key rope slices (interleaved pairs), the
  indexer's rope-first rows with the rest copied and stored fp32 (interleaved and half-split), mixed
  x / table dtypes, zero rows. fp16 and fp32 results equal the torch function's bit for bit where
  the roundings are the same (fp16); fp32 within float32 rounding (the compiler may fuse a product
  into the difference).
* ``test_rope_compiles_for_sm90``: compiles to an sm_90 cubin on the CPU for bf16 at the
  DeepSeek-V3.2 shapes.
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

SEED = int(os.environ.get("ROPE_TEST_SEED", secrets.randbits(31)))


def _tables(gen, T: int, half: int, dtype: torch.dtype):
    """cos / sin ``[T, half]`` as `models.rope.RotaryEmbedding` makes them: fp32 math, cast to ``dtype``."""
    ang = torch.rand(T, half, generator=gen) * 6.3
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor, rounded_in: torch.dtype) -> None:
    """Bit for bit when the math rounds to fp16 at every op (as torch's does); within float32 rounding
    when it computes in fp32 (the compiler may fuse a product into the difference)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if rounded_in == torch.float16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=3e-6)


def check_mla_slices(gen) -> None:
    from models.ops import rope_cuda as k
    from models.rope import apply_rope

    for dtype in (torch.float16, torch.float32):
        T, H, nope, rope = 5, 3, 16, 8
        q = (torch.randn(T, H, nope + rope, generator=gen) * 2).to(dtype)
        cos, sin = _tables(gen, T, rope // 2, dtype)
        q_pe = q[..., nope:]
        assert k.supports(q_pe, cos, rope)
        want = apply_rope(q_pe, cos, sin, interleaved=True)  # CPU: the torch spec
        _same(k.apply_rope(q_pe, cos, sin, interleaved=True), want, dtype)
        kv = (torch.randn(T, 12 + rope, generator=gen)).to(dtype)
        k_pe = kv[:, None, 12:]
        _same(k.apply_rope(k_pe, cos, sin, interleaved=True)[:, 0], apply_rope(k_pe, cos, sin, interleaved=True)[:, 0],
              dtype)
        empty = q_pe[:0]
        assert k.apply_rope(empty, cos[:0], sin[:0], interleaved=True).shape == (0, H, rope)


def check_indexer_rows(gen) -> None:
    from models.ops import rope_cuda as k
    from models.rope import apply_rope

    for dtype in (torch.float16, torch.float32):
        for interleaved in (True, False):
            T, H, D, R = 4, 5, 32, 8
            x = (torch.randn(T, H, D, generator=gen) * 3).to(dtype)
            cos, sin = _tables(gen, T, R // 2, dtype)
            want = torch.cat([apply_rope(x[..., :R], cos, sin, interleaved), x[..., R:]], dim=-1).float()
            _same(k.apply_rope(x, cos, sin, interleaved, rotate=R, out_dtype=torch.float32), want, dtype)
            x2 = x[:, 0]  # 2-D rows (the indexer's keys)
            want2 = torch.cat([apply_rope(x2[..., :R], cos, sin, interleaved), x2[..., R:]], dim=-1).float()
            _same(k.apply_rope(x2, cos, sin, interleaved, rotate=R, out_dtype=torch.float32), want2, dtype)


def check_mixed_dtypes(gen) -> None:
    from models.ops import rope_cuda as k
    from models.rope import apply_rope

    x = (torch.randn(3, 2, 8, generator=gen)).to(torch.float16)
    cos, sin = _tables(gen, 3, 4, torch.float32)  # promoted: fp32 math and output, as torch does
    _same(k.apply_rope(x, cos, sin, interleaved=False), apply_rope(x, cos, sin, interleaved=False), torch.float32)


CHECKS = {"mla_slices": check_mla_slices, "indexer_rows": check_indexer_rows, "mixed_dtypes": check_mixed_dtypes}

PRESTART, interpreter_results, test_rope_interpreter = kernel_suite(__file__, SEED, CHECKS, "ROPE_TEST_SEED", "test_rope_compiles_for_sm90")
"""The subprocesses this module reads, started early (tests/prestart.py); the interpreter checks' fixture and test."""


def _compile_worker() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.ops import rope_cuda as k

    sig = dict(x_ptr="*bf16", x_stride_t="i64", x_stride_h="i64", cos_ptr="*bf16", sin_ptr="*bf16",
               cs_stride="i64", out_ptr="*bf16", H="i32")
    # MLA's query / key rope (64 dims, interleaved), the indexer's 128-dim rows rope-first into fp32.
    for D, R, interleaved, out in ((64, 64, True, "*bf16"), (128, 64, False, "*fp32"), (128, 64, True, "*fp32")):
        consts = dict(D=D, R=R, INTERLEAVED=interleaved, CALC=1, HALF_BLOCK=R // 2,
                      REST_BLOCK=triton.next_power_of_2(max(D - R, 1)))
        src = ASTSource(fn=k._rope_kernel, signature={**sig, "out_ptr": out, **{c: "constexpr" for c in consts}},
                        constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))


def test_rope_compiles_for_sm90():
    compiled(compile_run(__file__))


def test_cpu_tensors_keep_the_torch_path():
    from models.rope import fused_rope

    assert fused_rope(torch.randn(2, 8), torch.randn(2, 4), 8) is None


if __name__ == "__main__":
    worker_main(sys.argv[1:], CHECKS, _compile_worker)
