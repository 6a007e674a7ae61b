"""The fused Triton indexer-query quantization (``models/ops/index_query_cuda.py``) against the torch spec
(`models.indexer.quantize_query_fp8` and the weight products of `Indexer.forward`).

* ``test_index_query_interpreter``: CPU tensors through Triton's interpreter (one subprocess with
  ``TRITON_INTERPRET=1``: this file run as a script), fresh random queries each run
  (``INDEX_QUERY_TEST_SEED`` replays one), DeepSeek-V3.2's 64 heads x 128 and GLM-5's 32 heads, with
  outliers, an all-zero row and zero tokens: the fp8 bytes equal torch's bit for bit, the weights to fp32
  rounding.
* ``test_index_query_compiles_for_sm90``: the kernel compiles to an sm_90 cubin on the CPU.
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

from tests.triton_interpreter import compile_run, compile_sm90, compiled, kernel_suite, worker_main  # noqa: E402

SEED = int(os.environ.get("INDEX_QUERY_TEST_SEED", secrets.randbits(31)))


def check_against_torch(gen) -> None:
    from models.indexer import quantize_query_fp8
    from models.ops import index_query_cuda as k

    for T, H in ((1, 64), (7, 64), (5, 32), (0, 64)):
        q = torch.randn(T, H, 128, generator=gen) * 3
        if T > 1:
            q[1, 3] = 0.0                       # an all-zero row: amax clamps to 1e-10
            q[0, 0, 5] = 900.0                  # an outlier
        w = torch.randn(T, H, generator=gen)
        factor = H**-0.5 * 128**-0.5
        q8, w_out = k.quantize_query(q, w, factor)
        want_q8, scale = quantize_query_fp8(q)
        assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape
        assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8)), (T, H)
        torch.testing.assert_close(w_out, w * factor * scale, rtol=0, atol=0)


CHECKS = {"against_torch": check_against_torch}

PRESTART, interpreter_results, test_index_query_interpreter = kernel_suite(
    __file__, SEED, CHECKS, "INDEX_QUERY_TEST_SEED", "test_index_query_compiles_for_sm90")
"""The subprocesses this module reads, started early (tests/prestart.py); the interpreter checks' fixture and test."""


def _compile_worker() -> None:
    from models.ops import index_query_cuda as k

    sig = dict(q_ptr="*fp32", w_ptr="*fp32", q8_ptr="*u8", w_out_ptr="*fp32", factor="fp32", n_rows="i32")
    compile_sm90(k._quantize_query_kernel, sig, dict(D=128, BLOCK_R=16), num_warps=4)


def test_index_query_compiles_for_sm90():
    compiled(compile_run(__file__))


def test_supports():
    from models.ops import index_query_cuda as k

    assert k.supports(torch.empty(2, 64, 128)) and not k.supports(torch.empty(2, 64, 100))
    assert not k.supports(torch.empty(2, 64, 128, dtype=torch.bfloat16))


if __name__ == "__main__":
    worker_main(sys.argv[1:], CHECKS, _compile_worker)
