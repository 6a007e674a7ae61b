#!/usr/bin/env bash
# One GPU-machine call (~4-5 min on an H100): the transfer experiments that decide
# issue 4's next step. Usage (device run, repo root, .devicewheels/nixl carried):
#   [CASES=layouts|ucx|threads|ab|receiver|single] bash bench/gpu_transfer.sh [extra bench/transfer.py args...]
# The host has torch but no nixl: its wheels come from .devicewheels/nixl
# (../shared/offline-wheels, pack_wheels.py --groups nixl). Results land in $OUT.
#
# Questions, each answered by ratios to a torch copy measured in the same run
# (UCX scatter-gather offload on, as served; pairs warmed up at start):
#   1. page-major cache, scattered page ids (one ~3.08 MB descriptor per page):
#      single request and a stream of requests (--inflight): >= 0.8 of the copy?
#   2. layer-major cache (today's pool), contiguous page ids (what the new
#      PagePool hands out): does a stream reach 0.8 where one request got 0.41?
#   3. page-major cache with runs of 1-16 page ids, and 8 requests in flight.
#   4. layer-major, runs of 1-16 (fragmented pool): the stream baseline.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicewheels/nixl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{
  date -u; git log --oneline -1 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, importlib.metadata as md; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nixl', md.version('nixl'))"
} 2>&1 | tee "$OUT/versions.txt"

COMMON=(--warmup --ucx-sgl on --tokens 8192,32768 --reps 5 --stream-reps 3)
{ nproc; lscpu 2>/dev/null | grep -E "Model name|Thread\(s\)|Core\(s\)|Socket|NUMA node\(s\)"; } | tee -a "$OUT/versions.txt"
run_case() {  # name, timeout seconds, bench args...
  local name=$1 limit=$2; shift 2
  echo "=== $name: bench/transfer.py $*" | tee "$OUT/$name.txt"
  timeout "$limit" python3 bench/transfer.py "$@" --json "$OUT/$name.json" 2>&1 | tee -a "$OUT/$name.txt" | grep -v "^reference\|^# \|^verified\|NIXL INFO" | grep -E "${SHOW:-.}" | tail -14
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
}
if [ "${CASES:-layouts}" = single ]; then
  # Single requests alone (8k, 32k; layer-major, contiguous page ids as the pool hands out):
  # the serving path (auto: explicit descriptors for few page runs) vs prepared lists, the
  # re-posted WRITE (the transport alone), and the first request after start with and
  # without a notification on the warm-up WRITE; streams of 8 in flight; 8 and 16 posting
  # threads, and none with SGL on (the old default).
  S=(--warmup --reps 5 --tokens 8192,32768 --layout contiguous --raw-reps 5)
  th() { echo --ucx-sgl off --ucx-threads "$1" --ucx-param num_workers="$1" --ucx-param split_batch_size=8; }
  run_case single_t8 90 "${S[@]}" $(th 8) --paths auto,prep --inflight 8 "$@"
  run_case single_t8_warmup_nonotif 60 "${S[@]}" $(th 8) --paths auto --warmup-notif off "$@"
  run_case single_t0_sgl 90 "${S[@]}" --ucx-sgl on --paths auto --inflight 8 "$@"
  run_case single_t8_again 90 "${S[@]}" $(th 8) --paths auto,prep --inflight 8 "$@"
  echo "results: $OUT/*.txt, $OUT/*.json"
  exit 0
fi
if [ "${CASES:-layouts}" = ab ]; then
  # Interleaved A/B, twice (run-to-run spread was ~1.6x for one config):
  # no posting threads + scatter-gather (the old default) vs 8 posting threads
  # on 8 UCX workers, scatter-gather off; page-major runs and layer-major
  # contiguous (today's pool); 32k, 8 requests in flight.
  B=(--warmup --reps 3 --stream-reps 3 --paths prep --tokens 32768 --inflight 8)
  TH=(--ucx-sgl off --ucx-threads 8 --ucx-param num_workers=8 --ucx-param split_batch_size=8)
  for rep in 1 2; do
    run_case ab${rep}_pm_base 60 "${B[@]}" --cache-layout page-major --layout runs --ucx-sgl on "$@"
    run_case ab${rep}_pm_threads8 60 "${B[@]}" --cache-layout page-major --layout runs "${TH[@]}" "$@"
    run_case ab${rep}_lm_base 60 "${B[@]}" --layout contiguous --ucx-sgl on "$@"
    run_case ab${rep}_lm_threads8 60 "${B[@]}" --layout contiguous "${TH[@]}" "$@"
  done
  echo "results: $OUT/*.txt, $OUT/*.json"
  exit 0
fi
if [ "${CASES:-layouts}" = receiver ]; then
  # 8 posting threads on both agents (today's KVLink) vs on the pushing agent
  # only (the receiver never posts), interleaved, twice; layer-major contiguous.
  B=(--warmup --reps 3 --stream-reps 3 --paths prep --tokens 32768 --inflight 8 --layout contiguous
     --ucx-sgl off --ucx-threads 8 --ucx-param num_workers=8 --ucx-param split_batch_size=8)
  for rep in 1 2; do
    run_case rx${rep}_both 60 "${B[@]}" "$@"
    run_case rx${rep}_pusher_only 60 "${B[@]}" --receiver-defaults "$@"
  done
  echo "results: $OUT/*.txt, $OUT/*.json"
  exit 0
fi
if [ "${CASES:-layouts}" = threads ]; then
  # The WRITE split over 4 posting threads on 4 UCX workers (4 CUDA streams),
  # scatter-gather off (the best of the `ucx` set), on every layout.
  T=(--warmup --reps 3 --stream-reps 2 --paths prep --ucx-sgl off --ucx-threads 4
     --ucx-param num_workers=4 --ucx-param split_batch_size=8)
  run_case threads_layer_major_contiguous 90 "${T[@]}" --tokens 8192,32768 --layout contiguous --inflight 4 "$@"
  run_case threads_page_major_runs 90 "${T[@]}" --tokens 8192,32768 --cache-layout page-major --layout runs \
      --inflight 8 "$@"
  run_case threads_layer_major_runs 90 "${T[@]}" --tokens 32768 --layout runs --inflight 4 "$@"
  run_case threads8_page_major_runs 75 --warmup --reps 3 --stream-reps 2 --paths prep --ucx-sgl off \
      --ucx-threads 8 --ucx-param num_workers=8 --ucx-param split_batch_size=8 --tokens 32768 \
      --cache-layout page-major --layout runs --inflight 8 "$@"
  echo "results: $OUT/*.txt, $OUT/*.json"
  exit 0
fi
if [ "${CASES:-layouts}" = ucx ]; then
  # UCX / NIXL settings, A/B on the best layout of the first set (page-major,
  # runs of 1-16, 8 in flight, 32k). cuda_ipc puts every copy to one peer GPU
  # from one UCX worker on one CUDA stream, and the progress thread arms host
  # callbacks on that stream whenever it sleeps: so (b) no progress thread,
  # (c, d) the WRITE split over 4 posting threads on 4 UCX workers (4 streams),
  # (e) more completions drained per progress call.
  U=(--warmup --tokens 32768 --reps 3 --stream-reps 2 --cache-layout page-major --layout runs --paths prep
     --inflight 8)
  run_case ucx_a_baseline 75 "${U[@]}" --ucx-sgl on "$@"
  run_case ucx_b_no_progress_thread 75 "${U[@]}" --ucx-sgl on --no-progress-thread "$@"
  run_case ucx_c_4threads_4workers_sgl_off 75 "${U[@]}" --ucx-sgl off --ucx-threads 4 \
      --ucx-param num_workers=4 --ucx-param split_batch_size=8 "$@"
  run_case ucx_d_4threads_4workers_sgl_on 75 "${U[@]}" --ucx-sgl on --ucx-threads 4 \
      --ucx-param num_workers=4 --ucx-param split_batch_size=8 "$@"
  export UCX_CUDA_IPC_MAX_POLL=256
  run_case ucx_e_max_poll_256 75 "${U[@]}" --ucx-sgl on "$@"
  unset UCX_CUDA_IPC_MAX_POLL
  run_case ucx_f_layer_major_contiguous_4threads 75 --warmup --tokens 32768 --reps 3 --stream-reps 2 \
      --layout contiguous --paths prep --inflight 4 --ucx-sgl off --ucx-threads 4 \
      --ucx-param num_workers=4 --ucx-param split_batch_size=8 "$@"
  echo "results: $OUT/*.txt, $OUT/*.json"
  exit 0
fi
run_case page_major_random 75 "${COMMON[@]}" --layout page-major --paths prep,flat --inflight 4 "$@"
run_case layer_major_contiguous 60 "${COMMON[@]}" --layout contiguous --paths prep --inflight 4 "$@"
run_case page_major_runs_inflight8 75 "${COMMON[@]}" --cache-layout page-major --layout runs --paths prep --inflight 8 "$@"
run_case layer_major_runs 75 "${COMMON[@]}" --layout runs --paths prep --inflight 4 "$@"
echo "results: $OUT/*.txt, $OUT/*.json"
