#!/usr/bin/env bash
# One GPU-machine call: install the carried wheels, print versions, run the
# `gpu` tests and the transfer bench. Usage (device run, repo root):
#   bash bench/gpu_checks.sh [transfer-bench-args...]
# Wheels come from .devicewheels/{kernels,nixl} (../shared/offline-wheels) and .whl (pytest).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .devicewheels/kernels/*.whl .devicewheels/nixl/*.whl .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, nixl; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import flash_mla, deep_gemm; print('flash_mla ok, deep_gemm ok')"
} 2>&1 | tee "$OUT/versions.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/attention/test_triton_kernels.py tests/transfer/test_transfer_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
python3 bench/transfer.py --json "$OUT/transfer_cold.json" "$@" 2>&1 | tee "$OUT/transfer_cold.txt" | tail -30
python3 bench/transfer.py --warmup --json "$OUT/transfer_warm.json" "$@" 2>&1 | tee "$OUT/transfer_warm.txt" | tail -30
