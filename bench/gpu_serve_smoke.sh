#!/usr/bin/env bash
# Last of three device calls (the first two copy .devicewheels/ray1 and
# ray2+nixl into /tmp/wheels): install the whole stack, start
# `serve run configs/tiny_pd_gpu.yaml` and talk to it over HTTP.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/wheels
cp .devicewheels/kernels/*.whl .whl/*.whl /tmp/wheels/ 2>/dev/null
# A fresh target: pip --target leaves an existing bin/ alone, and `serve` must be in it.
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheels/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 DSA_PD_CACHE=/tmp/dsa-cache RAY_DEDUP_LOGS=0
python3 -c "import ray, nixl, transformers, flash_mla, deep_gemm; print('ray', ray.__version__, 'transformers', transformers.__version__)" 2>&1 | tee "$OUT/versions.txt"
python3 -m deployments.cli check configs/tiny_pd_gpu.yaml 2>&1 | tail -6
serve run configs/tiny_pd_gpu.yaml > "$OUT/serve.log" 2>&1 &
SERVE=$!
for i in $(seq 1 120); do
  curl -sf localhost:8000/health >/dev/null 2>&1 && break
  kill -0 $SERVE 2>/dev/null || { echo "serve run exited"; break; }
  sleep 2
done
curl -s localhost:8000/health; echo
curl -s localhost:8000/v1/models; echo
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"model":"tiny-deepseek-v32","prompt":"Hello, sparse attention","max_tokens":16,"temperature":0}' | tee "$OUT/completion.json"; echo
curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model":"tiny-deepseek-v32","messages":[{"role":"user","content":"hi"}],"max_tokens":12,"stream":true}' | tee "$OUT/chat_stream.txt" | tail -3; echo
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"model":"nope","prompt":"x"}'; echo
python3 bench/openai_client_smoke.py 2>&1 | tee "$OUT/openai_client.txt"
curl -s localhost:8000/stats; echo
grep -h "CUDA graphs" "$OUT/serve.log" | tail -3
tail -40 "$OUT/serve.log" | grep -v "NIXL INFO" | tail -25
serve shutdown -y >/dev/null 2>&1; ray stop -f >/dev/null 2>&1; true
