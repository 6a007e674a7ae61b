"""Compile the prefill path's kernels at start-up, not in the first requests.

Triton and DeepGEMM compile a kernel the first time they meet a shape class: the fp8 GEMMs' tile
configurations follow the number of rows, DeepGEMM's JIT builds one kernel per (N, K, its M-tile
choice), the grouped expert GEMMs follow the rows per expert. On the H100 the first 16k-token
prompt after start prefilled at 6.9k tokens/s against 33.8k warm. A replica on the ``cuda``
backend therefore runs one prefill forward of each size in `warmup_sizes` before it serves (the
decode path is compiled already: CUDA-graph capture runs every decode bucket once). Powers of
two alone were not enough: on the H100 a served fp8 checkpoint stalled for seconds in its first
batched requests (docs/perf.md, session 16), and an fp8 GEMM of 300 rows compiled for 20.9 s
after 256 and 512 had run (bench/fp8_first_use.py). The sizes now include the row counts that
compile every variant of the fp8 GEMMs (`models.ops.fp8_linear_cuda.first_use_rows`; DeepGEMM's
rows are padded to the powers of two, `deepgemm_rows`).

The forwards write their KV into pages taken from the pool and given back at once; nothing else
is touched (no request, no sampling), so the engine starts exactly as without warm-up.
"""

from __future__ import annotations

import logging
import time

import torch

from attention.formats import PAGE_SIZE
from models.batch import ForwardMode
from models.ops.fp8_linear_cuda import first_use_rows
from workers.model_runner import WorkItem

log = logging.getLogger(__name__)


def warmup_sizes(chunk_size: int, max_tokens: int) -> list[int]:
    """Prompt lengths to prefill once, ascending: `first_use_rows`, the powers of two from 16 up to
    the prefill chunk, and the chunk itself, none above ``max_tokens`` (what the pool and the
    model's positions allow)."""
    top = min(chunk_size, max_tokens)
    sizes = {n for n in first_use_rows() if n <= top} | {n for n in (16 << k for k in range(16)) if n < top}
    return sorted(sizes | {top}) if top >= 1 else sorted(sizes)


def warm_up_prefill(runner, pool, chunk_size: int, max_positions: int) -> dict[int, float]:
    """One prefill forward per `warmup_sizes` length through ``runner``; ``{tokens: seconds}``.

    Every page it takes from ``pool`` goes back before it returns (also on an error)."""
    took: dict[int, float] = {}
    for n in warmup_sizes(chunk_size, min(max_positions, pool.free_count * PAGE_SIZE)):
        pages = pool.allocate_for_tokens(n)
        try:
            t = time.perf_counter()
            # Token ids cycle through a small range: any id the vocabulary has, no special meaning.
            runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(3 + i % 200 for i in range(n)), 0, tuple(pages))])
            if torch.cuda.is_available() and str(getattr(runner, "device", "")).startswith("cuda"):
                torch.cuda.synchronize()
            took[n] = time.perf_counter() - t
            # One line a size as it ends: a first-use compile shows as the size it held up.
            log.info("prefill warm-up: %d tokens in %.2f s", n, took[n])
        finally:
            pool.free(pages)
    if took:
        log.info("prefill kernels warmed up for %s tokens in %.1f s", sorted(took), sum(took.values()))
    return took
