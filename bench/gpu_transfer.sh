#!/usr/bin/env bash
# One GPU-machine call (~1-2 min): the transfer experiments behind docs/perf.md's
# latest transfer section. Usage (device run, repo root, .devicewheels/nixl carried):
#   [CASES=served|layout|sweep|anatomy] [RUNS=...] [SHOW=regex] bash bench/gpu_transfer.sh [extra bench/transfer.py args...]
# (e.g. `--devices 0,1` on two GPUs). The host has torch but no nixl: its wheels
# come from .devicewheels/nixl (../shared/offline-wheels, pack_wheels.py --groups
# nixl). Results land in $OUT; SHOW filters what each case prints.
#
# Every figure is a ratio to a torch copy of the same bytes measured in the same
# run (device copy on one GPU, peer copy between two), with contiguous page ids
# (what workers/page_pool.py hands out), pairs warmed up at start, every push
# verified page for page.
#   served (default): the served setting (workers/push_tuning.py: cross-layer cache,
#     whole page runs, 8 posting threads taking WRITEs of >= 2 descriptors, no
#     NIXL progress thread on the pushing agent) vs session 5's (runs cut into
#     16-page descriptors, every WRITE split over the threads, progress thread on),
#     on contiguous and on fragmented page ids (--layout runs), interleaved, twice.
#   lone: a request alone and the torch copy of its bytes timed alone the same way, served
#     setting: after a pipe read and after 3 ms of device work waited for (each unfenced, in
#     parts, and fenced as served), and fenced while that work still runs (posted when the
#     CUDA event recorded after it passes), interleaved, twice.
#   fence: a request alone after a pipe read, unfenced and fenced three ways (--fence-kind:
#     served, none if the stream is idle; always an event; waiting for the stream), interleaved, twice.
#   layout: requests alone (8k, 32k) on the serving path, the
#     re-posted WRITE (the transport alone), the first request after start,
#     streams of 8 in flight; session 5's setting (cross-layer cache: one
#     region, runs cut into 16-page descriptors, split_batch_size 1) vs the
#     per-layer cache as served before (a region per layer: 61 descriptors
#     per run, split_batch_size 8) and cross-layer with 8-page descriptors,
#     interleaved, twice.
#   anatomy: one 8k request timed with one thing changed at a time (re-posted or
#     fresh handle, notification, new pages, the Pusher; decode idle or polling)
#     for 16-, 8-page and whole-run descriptors, with NIXL posting on its threads
#     (split_batch_size 1, session 5's) and on the calling thread (1024), twice.
#   sweep: the same measurements for RUNS="name:bench args;..." (a name ending
#     in _sbsN sets split_batch_size N, else 8), interleaved, twice. Session 4's
#     `single` (per-layer vs layer-major) is RUNS="per_layer:;layer_major:--cache-layout layer-major".
# Earlier case sets are in git history: `single` and `ab` at f535a37 (docs/perf.md
# session 4); layouts, ucx, threads, receiver at 1532f00 (sessions 2-3).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicewheels/nixl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{
  date -u; git log --oneline -1 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, importlib.metadata as md; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nixl', md.version('nixl'))"
  nproc; lscpu 2>/dev/null | grep -E "Model name|Thread\(s\)|Core\(s\)|Socket|NUMA node\(s\)"
} 2>&1 | tee "$OUT/versions.txt"

run_case() {  # name, timeout seconds, bench args...
  local name=$1 limit=$2; shift 2
  echo "=== $name: bench/transfer.py $*" | tee "$OUT/$name.txt"
  timeout "$limit" python3 bench/transfer.py "$@" --json "$OUT/$name.json" 2>&1 | tee -a "$OUT/$name.txt" \
      | grep -v "^reference\|^# \|^verified\|NIXL INFO" | grep -E "${SHOW:-.}" | tail -"${TAIL:-14}"
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
}
th() { echo --ucx-sgl off --ucx-threads "$1" --ucx-param num_workers="$1" --ucx-param split_batch_size=${2:-8}; }

SERVED=(--cache-layout cross-layer $(th 8 2) --no-prefill-progress-thread)
SESSION5=(--cache-layout cross-layer --run-pages 16 $(th 8 1))
case "${CASES:-served}" in
  served)
    S=(--warmup --reps 5 --tokens 8192,32768 --raw-reps 5 --paths auto --inflight 8)
    for rep in 1 2; do
      for layout in contiguous runs; do
        run_case served${rep}_${layout} 90 "${S[@]}" --layout $layout "${SERVED[@]}" "$@"
        run_case session5_${rep}_${layout} 90 "${S[@]}" --layout $layout "${SESSION5[@]}" "$@"
      done
    done
    ;;
  layout)
    S=(--warmup --reps 5 --tokens 8192,32768 --layout contiguous --raw-reps 5 --paths auto --inflight 8)
    for rep in 1 2; do
      run_case layout${rep}_cross_layer_16 90 "${S[@]}" $(th 8 1) --cache-layout cross-layer --run-pages 16 "$@"
      run_case layout${rep}_per_layer 90 "${S[@]}" $(th 8) "$@"
      run_case layout${rep}_cross_layer_8 90 "${S[@]}" $(th 8 1) --cache-layout cross-layer --run-pages 8 "$@"
    done
    ;;
  sweep)  # RUNS="name:args;name:args", interleaved, twice
    S=(--warmup --reps 5 --tokens 8192,32768 --layout contiguous --raw-reps 5 --paths auto --inflight 8)
    IFS=';' read -ra entries <<< "${RUNS:?sweep needs RUNS}"
    for rep in 1 2; do
      for e in "${entries[@]}"; do
        name=${e%%:*}; extra=${e#*:}
        sbs=${name##*_sbs}; [ "$sbs" = "$name" ] && sbs=8
        # shellcheck disable=SC2086
        run_case sweep${rep}_${name} 90 "${S[@]}" $(th 8 "$sbs") $extra "$@"
      done
    done
    ;;
  anatomy)  # where an 8k request's time goes (bench/transfer.py --anatomy-reps), served setting vs
            # NIXL posting on the calling thread (split_batch_size above the descriptor count)
    S=(--warmup --reps 5 --tokens 8192,32768 --layout contiguous --raw-reps 5 --paths auto --inflight 8
       --cache-layout cross-layer --run-pages 16 --anatomy-reps 9 --anatomy-run-pages 16,8,0)
    for rep in 1 2; do
      run_case anatomy${rep}_sbs1 120 "${S[@]}" $(th 8 1) "$@"
      run_case anatomy${rep}_sbs1024 120 "${S[@]}" $(th 8 1024) "$@"
    done
    ;;
  lone)  # a request alone next to the same bytes copied alone (--copy-alone), served setting:
          # pushed after the process sat in a pipe read (unfenced, in parts; fenced as served),
          # after 3 ms of device work it waited for (a forward that samples; unfenced, in parts;
          # fenced as served), and fenced while that work still runs (serving's push after the MTP
          # layer's forward: posted by the poll that sees the event pass), interleaved, twice
    S=(--warmup --reps 7 --tokens 8192,32768 --layout contiguous --raw-reps 5 --paths auto --inflight 8
       --copy-alone "${SERVED[@]}")
    for rep in 1 2; do
      run_case lone${rep}_idle 90 "${S[@]}" --lone-parts "$@"
      run_case lone${rep}_idle_fenced 90 "${S[@]}" --fenced "$@"
      run_case lone${rep}_forward 90 "${S[@]}" --forward-ms 3 --lone-parts "$@"
      run_case lone${rep}_forward_fenced 90 "${S[@]}" --forward-ms 3 --fenced "$@"
      run_case lone${rep}_running_fenced 90 "${S[@]}" --forward-ms 3 --fenced --forward-running "$@"
    done
    ;;
  fence)  # a request alone pushed after a pipe read: unfenced, and fenced three ways (--fence-kind:
           # served (no event if the stream is idle), always an event (served before session 8),
           # waiting for the stream), interleaved, twice
    S=(--warmup --reps 7 --tokens 8192,32768 --layout contiguous --raw-reps 5 --paths auto --inflight 8
       --copy-alone "${SERVED[@]}")
    for rep in 1 2; do
      run_case fence${rep}_none 90 "${S[@]}" "$@"
      for kind in served event sync; do
        run_case fence${rep}_${kind} 90 "${S[@]}" --fenced --fence-kind $kind "$@"
      done
    done
    ;;
  *) echo "unknown CASES=${CASES}: served, lone, fence, layout, sweep or anatomy" >&2; exit 2 ;;
esac
echo "results: $OUT/*.txt, $OUT/*.json"
