#!/usr/bin/env bash
# One GPU-machine call for the engine on the cuda backend (issues 3 and 5):
# install the carried wheels, then run the CUDA-graph decode test (replay ==
# eager), the 32k / 128k chunked-prefill test, the end-to-end LLM tests, the
# Triton kernel tests, bench/engine.py and bench/attention.py.
# Usage (device run, repo root): bash bench/gpu_engine.sh
# Carry: .devicewheels/kernels (../shared/offline-wheels, --groups kernels) and
# .whl (pytest + transformers 5.23.0: the host's 5.17 lacks deepseek_v32 / glm_moe_dsa).
# Each part has its own time limit (seconds, env overridable) so one slow part
# cannot eat the others'.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .devicewheels/kernels/*.whl .whl*/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import flash_mla, deep_gemm; print('flash_mla ok, deep_gemm ok')"
} 2>&1 | tee "$OUT/versions.txt"
PYT="python3 -m pytest -q -p no:cacheprovider -m gpu -rA -s"
FILTER="PASSED|FAILED|ERROR|passed|failed|Error|assert|GRAPHS|LONG|E2E|NOISE"
timeout ${GRAPH_TESTS_S:-150} $PYT tests/workers/test_decode_graphs_gpu.py 2>&1 | tee "$OUT/gpu_graph_tests.txt" | grep -E "$FILTER" | tail -20
timeout ${ENGINE_BENCH_S:-150} python3 bench/engine.py --json "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench_engine.txt" | tail -16
timeout ${KERNEL_TESTS_S:-90} $PYT tests/attention/test_triton_kernels.py 2>&1 | tee "$OUT/gpu_kernel_tests.txt" | grep -E "$FILTER" | tail -20
timeout ${LONG_TESTS_S:-150} $PYT tests/workers/test_long_prefill_gpu.py 2>&1 | tee "$OUT/gpu_long_prefill.txt" | grep -E "$FILTER" | tail -10
timeout ${ATTN_BENCH_S:-120} python3 bench/attention.py --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.txt" | tail -30
timeout ${LLM_TESTS_S:-200} $PYT tests/attention/test_cuda_backend.py -k "llm" 2>&1 | tee "$OUT/gpu_llm_tests.txt" | grep -E "$FILTER" | tail -20
