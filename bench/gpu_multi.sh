#!/usr/bin/env bash
# Several-GPU runs (issue 26) on nvidia-h200-x4 (or x2 for the tp 2 parts), one step per device call
# on one warm machine, results in $OUT. Carried: ray, nixl, the kernels and .whl (openai, transformers)
# as parts (bench/pack_device_parts.sh), one part per call.
#   bash bench/gpu_multi.sh stage [DIR] # once per part, carrying DIR/pNN (default DIR .devparts)
#   bash bench/gpu_multi.sh install    # unpack + one pip install into /tmp/site
#   bash bench/gpu_multi.sh tests      # tests/workers/test_tensor_parallel_gpu.py (tp 2, TBO, PD on 4 GPUs)
#   bash bench/gpu_multi.sh serve      # serve run of tp 2 PD on 4 GPUs, openai client
#   bash bench/gpu_multi.sh bench      # decode/prefill: tp 1 (graphs, eager), tp 2 (graphs, eager, eager +
#                                      # two-batch overlap); RUNS=... picks
#   bash bench/gpu_multi.sh transfer   # KV push GPU 0 -> GPU 1 against a peer copy (bench/gpu_transfer.sh)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
case "${1:?step}" in
stage)
  mkdir -p /tmp/parts && cp ${2:-.devparts}/p*/part* /tmp/parts/ && ls /tmp/parts ;;
install)
  mkdir -p /tmp/w && cat /tmp/parts/part* | tar xf - -C /tmp/w || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/w/.devicewheels/*/*.whl /tmp/w/.whl/*.whl $(ls /tmp/w/.whl2/*.whl .whl2/*.whl 2>/dev/null) 2>&1 | grep -v WARNING | tail -3
  tar xzf /tmp/w/.whl/tfslim.tgz -C /tmp/site
  mkdir -p .devicewheels && cp -r /tmp/w/.devicewheels/nixl .devicewheels/ 2>/dev/null  # gpu_transfer.sh's own install
  python3 -c "import ray, nixl, deep_gemm, flash_mla, openai, transformers, pydantic; print('ray', ray.__version__, 'transformers', transformers.__version__)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" ;;
tests)
  timeout ${T:-560} python3 -m pytest -q -rf -p no:cacheprovider -s ${TESTS:-tests/workers/test_tensor_parallel_gpu.py} \
      2>&1 | tee "$OUT/multi_tests.txt" | grep -E "passed|failed|FAILED|Error|TP2|^E " | tail -30 ;;
serve)
  timeout ${T:-560} python3 -m pytest -q -rf -p no:cacheprovider -s tests/deployments/test_serve_tensor_parallel_gpu.py \
      2>&1 | tee "$OUT/multi_serve.txt" | grep -E "passed|failed|FAILED|Error|served|^E " | tail -30 ;;
bench)
  [ -d /tmp/ckpt/bf16 ] || python3 bench/memory_check.py /tmp/ckpt/bf16 --layers 4 --experts 16 --write --write-only --bf16 | tail -1
  common="--model /tmp/ckpt/bf16 --backend cuda --device cuda --dtype bfloat16 --kv-cache-dtype fp8 \
      --prefill ${PREFILL:-8x4096} --batch-sizes ${BATCHES:-32 128} --input-len 1024 --output-len ${OUTLEN:-128}"
  for run in ${RUNS:-tp1 tp1-eager tp2 tp2-eager tp2-tbo}; do
    case $run in
      tp1) extra="" ;; tp1-eager) extra="--no-cuda-graphs" ;;
      tp2) extra="--tp-size 2" ;;  # every rank's decode graphs
      tp2-eager) extra="--tp-size 2 --no-cuda-graphs" ;;
      tp2-tbo) extra="--tp-size 2 --no-cuda-graphs --two-batch-overlap" ;;
      *) echo "unknown run $run: tp1, tp1-eager, tp2, tp2-eager or tp2-tbo"; continue ;;
    esac
    echo "== $run"
    timeout ${T:-240} python3 -m bench.offline $common $extra --json "$OUT/multi_$run.json" 2>&1 | \
        tee "$OUT/multi_$run.txt" | grep -E "tokens/s|TPOT|start-up|Error" | tail -8
  done ;;
transfer)
  CASES=${CASES:-ab} bash bench/gpu_transfer.sh --devices 0,1 2>&1 | tee "$OUT/multi_transfer.txt" | tail -30 ;;
esac
