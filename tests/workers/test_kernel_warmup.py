"""Start-up prefill warm-up (`workers.kernel_warmup`): which lengths, and that it leaves no trace.

On the ``cuda`` backend `workers.replica_build.build_replica` runs it (the compile it saves is a GPU
matter: docs/perf.md); here it runs on the reference backend, where it must give back every page and
change no output.
"""

from __future__ import annotations

import pytest

from models.ops import fp8_linear_cuda
from models.tiny import make_tiny
from workers.kernel_warmup import warm_up_prefill, warmup_sizes
from workers.offline import LLM

PROMPTS = [[5, 9, 200, 17] * 5, [33] * 70]


def test_warmup_sizes():
    assert warmup_sizes(8192, 1 << 20) == [1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 240, 256, 512, 1024, 2048,
                                           4096, 8192]
    assert warmup_sizes(100, 1 << 20) == [1, 2, 16, 17, 32, 33, 64, 65, 100]
    assert warmup_sizes(256, 40) == [1, 2, 16, 17, 32, 33, 40]


def _w8a16_variant(M: int, N: int, K: int) -> tuple:
    """What makes Triton compile `w8a16` anew: its launch configuration, and the specialization of
    the runtime row count (== 1, a multiple of 16, other)."""
    cfg = fp8_linear_cuda.w8a16_config(M, N, K, (128, 128), 132)
    return tuple(sorted(cfg.items())), M == 1, M % 16 == 0


@pytest.mark.parametrize("chunk", [8192, 6000, 300])
def test_warmup_compiles_every_fp8_gemm_variant_a_prefill_meets(chunk):
    """Every row count a prefill of at most ``chunk`` tokens gives the fp8 GEMMs launches a kernel
    variant that one of the warm-up's sizes launched first (DeepSeek-V3.2's projection shapes)."""
    sizes = warmup_sizes(chunk, 1 << 20)
    for N, K in [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (4096, 7168), (7168, 2048)]:
        warmed = {_w8a16_variant(n, N, K) for n in sizes if n < fp8_linear_cuda.DEEPGEMM_MIN_M}
        for M in range(1, fp8_linear_cuda.DEEPGEMM_MIN_M):
            assert _w8a16_variant(M, N, K) in warmed, f"w8a16 at M={M} (N={N}, K={K}) compiles after start-up"
    warmed_rows = {fp8_linear_cuda.deepgemm_rows(n) for n in sizes if n >= fp8_linear_cuda.DEEPGEMM_MIN_M}
    for M in range(fp8_linear_cuda.DEEPGEMM_MIN_M, chunk + 1):
        rows = fp8_linear_cuda.deepgemm_rows(M)
        assert rows >= M
        # Below DEEPGEMM_PAD_BELOW DeepGEMM picks tiles from the rows: only warmed row counts reach
        # it. From there the H100 showed no new compile (bench/fp8_first_use.py).
        assert rows in warmed_rows or rows >= fp8_linear_cuda.DEEPGEMM_PAD_BELOW, f"DeepGEMM at {rows} rows (M={M})"


def test_warm_up_gives_every_page_back_and_changes_nothing(tmp_path):
    model = make_tiny("deepseek_v32", tmp_path / "v32", seed=0)
    cold = LLM(model, num_pages=16, chunk_size=200).generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    llm = LLM(model, num_pages=16, chunk_size=200)
    took = warm_up_prefill(llm.runner, llm.pool, 200, llm.cfg.max_position_embeddings)
    assert sorted(took) == [1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 200]
    assert llm.pool.free_count == 16
    assert llm.generate(PROMPTS, max_new_tokens=6, ignore_eos=True) == cold
