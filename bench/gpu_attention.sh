#!/usr/bin/env bash
# One GPU-machine call for the cuda attention backend (issue 3): install the
# carried wheels, print versions, run the `gpu` tests of the backend, the
# top-k kernel tests (fused vs split, CUDA graph), the attention bench, then the
# end-to-end LLM tests. Usage (device run, repo root):
#   bash bench/gpu_attention.sh
# Carry: .devicewheels/kernels (../shared/offline-wheels, --groups kernels) and
# .whl (pytest + transformers 5.23.0: the host's 5.17 lacks deepseek_v32 / glm_moe_dsa).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .devicewheels/kernels/*.whl .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import flash_mla, deep_gemm; print('flash_mla ok, deep_gemm ok')"
} 2>&1 | tee "$OUT/versions.txt"
timeout ${KERNEL_TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
    tests/attention/test_cuda_backend.py -k "test_cuda_backend_gpu" 2>&1 | tee "$OUT/gpu_kernel_tests.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | tail -40
timeout ${TOPK_TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
    tests/attention/test_triton_kernels.py -k "topk" 2>&1 | tee "$OUT/gpu_topk_tests.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | tail -20
timeout ${BENCH_S:-180} python3 bench/attention.py --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.txt" | tail -40
timeout ${LLM_TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
    tests/attention/test_cuda_backend.py -k "llm or noise" 2>&1 | tee "$OUT/gpu_llm_tests.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert|E2E|NOISE" | tail -30
