#!/usr/bin/env bash
# One GPU-machine call for the fp8 weights (issue 18): install the carried kernels, run the fp8 GPU
# tests, then the graphed decode step at real dims against its HBM roofline, fp8 and bf16.
# Usage (device run, repo root; carry .devicewheels/kernels and .whl/tfslim.tgz):
#   bash bench/gpu_fp8.sh [tests|engine|memory|offline|all]     (TESTS="files...", TESTS_S=seconds)
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
  # TESTS_S bounds the tests here: a `timeout` around this script kills the shell, not pytest, which
  # then keeps the GPU busy under whatever the next call measures (session 19).
  timeout -k 10 "${TESTS_S:-420}" python3 -m pytest -q -rf -p no:cacheprovider ${TESTS:-tests/models/test_fp8_kernels.py \
      tests/models/test_moe_gpu.py tests/models/test_fp8_model_gpu.py} -s 2>&1 | tee "$OUT/fp8_tests.txt" | \
      grep -E "passed|failed|FAILED|Error|E2E" | tail -30
fi
if [ "$what" = memory ] || [ "$what" = all ]; then
  # The plan vs what loading allocates, at real dims (256 experts) truncated to what the disk holds.
  timeout 400 python3 bench/memory_check.py /tmp/ckpt/mem --layers ${LAYERS:-4} --write --json "$OUT/memory.json" \
      2>&1 | tee "$OUT/memory.txt" | tail -4
  rm -rf /tmp/ckpt/mem
fi
if [ "$what" = offline ] || [ "$what" = all ]; then
  for d in fp8 bf16; do
    [ -d /tmp/ckpt/$d ] || python3 bench/memory_check.py /tmp/ckpt/$d --layers 4 --experts 16 --write --write-only \
        $([ $d = bf16 ] && echo --bf16) | tail -1
    timeout 240 python3 -m bench.offline --model /tmp/ckpt/$d --backend cuda --device cuda --dtype bfloat16 \
        --kv-cache-dtype fp8 --prefill 8x4096 --batch-sizes 1 32 128 --input-len 1024 --output-len 128 ${PROFILE:-} \
        2>&1 | tee "$OUT/offline_$d.txt" | tail -${TAIL:-12}
  done
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
  for w in --fp8 ""; do
    timeout 200 python3 bench/engine.py --layers 2 --experts 256 --batch 1 32 128 --next-n 1 $w \
        --json "$OUT/engine${w:+_fp8}.json" 2>&1 | tee "$OUT/engine${w:+_fp8}.txt" | tail -7
  done
fi
