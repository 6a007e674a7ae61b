#!/usr/bin/env bash
# One GPU-machine call for the fp8 weights (issue 18): install the carried kernels, run the fp8 GPU
# tests, then the graphed decode step at real dims against its HBM roofline, fp8 and bf16.
# Usage (device run, repo root; carry .devicewheels/kernels and .whl/tfslim.tgz):
#   bash bench/gpu_fp8.sh [tests|engine|all]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
if [ ! -d /tmp/site/deep_gemm ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicewheels/kernels/*.whl 2>&1 | tail -2
  tar xzf .whl/tfslim.tgz -C /tmp/site
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python3 -m pytest -q -rf -p no:cacheprovider tests/models/test_fp8_kernels.py \
      tests/models/test_moe_gpu.py tests/models/test_fp8_model_gpu.py 2>&1 | tee "$OUT/fp8_tests.txt" | \
      grep -E "passed|failed|FAILED|Error|E2E" | tail -30
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
  for w in --fp8 ""; do
    timeout 200 python3 bench/engine.py --layers 2 --experts 256 --batch 1 32 128 --next-n 1 $w \
        --json "$OUT/engine${w:+_fp8}.json" 2>&1 | tee "$OUT/engine${w:+_fp8}.txt" | tail -7
  done
fi
