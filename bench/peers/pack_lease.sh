#!/usr/bin/env bash
# Everything a GPU lease carries, from a fresh checkout, in one command (repo root; PyPI reachable):
#   bash bench/peers/pack_lease.sh            # dsa-pd's stack + vLLM 0.26.0 -> .devparts/pNN (56 MiB each)
#   NO_VLLM=1 bash bench/peers/pack_lease.sh  # dsa-pd's stack only (three parts)
# It writes, all git-excluded (.git/info/exclude is extended here):
#   .devicewheels/{kernels,nixl,ray1,ray2}  ../shared/offline-wheels/pack_wheels.py
#   .whl   tfslim.tgz (transformers, the version installed here, whole: AutoTokenizer imports model folders
#          dsa-pd never uses; untarred into /tmp/site) and the openai client with what the host lacks
#   .whl2  llguidance (structured outputs; pyproject requires it) and grpcio >= 1.85.1 (ray2's
#          grpcio-reflection needs it; the image's 1.84 stops `serve run`)
#   .vllmsel  ../shared/offline-wheels/pack_vllm.sh's selection (vLLM 0.26.0 and its runtime needs)
# The parts hold one tar, dsa-pd's wheels first: the first three parts alone install dsa-pd's stack
# (`DSA_ONLY=1 bash bench/peers/run_peer.sh install`). models/checkpoints/small-v32 (36 MiB) must be moved
# out of the tree for the lease: the device tool carries the tracked tree (~6 MiB without it) plus one
# part per call (64 MiB in all): `bash bench/peers/checkpoint_aside.sh out`, and `... back` afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${SHARED:-../shared/offline-wheels}
for p in /.devicewheels/ /.devparts/ /.vllmparts/ /.whl/ /.whl2/ /.vllmsel/ /_before/; do
  grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 --platform any"

[ -d .devicewheels/kernels ] || python3 "$SHARED/pack_wheels.py"

rm -rf .whl .whl2 && mkdir -p .whl .whl2
# The host image has anyio, httpx, pydantic comes with ray2; openai >= 3 talks through httpx2.
v() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
$DL -d .whl "openai==$(v openai)" "httpx2==$(v httpx2)" "httpcore2==$(v httpcore2)" "jiter==$(v jiter)" \
    "sniffio==$(v sniffio)" "distro" "truststore"   # typing-inspection comes with ray2
$DL -d .whl2 "llguidance==$(v llguidance)" "grpcio>=1.85.1,<1.86"
# transformers (10 MiB packed): the host has 5.17; dsa-pd needs >= 5.23 (deepseek_v32, glm_moe_dsa; deepseek_v4 >= 5.24).
T=$(mktemp -d)
python3 -m pip install -q --no-deps --no-compile --target "$T" "transformers==$(v transformers)"
tar czf .whl/tfslim.tgz -C "$T" transformers "transformers-$(v transformers).dist-info"
rm -rf "$T"

parts=(.devicewheels/kernels .devicewheels/nixl .devicewheels/ray1 .devicewheels/ray2 .whl .whl2)
if [ -z "${NO_VLLM:-}" ]; then
  W=${W:-/tmp/vllm-peer-build}
  [ -d "$W/sel" ] && ls "$W/sel"/vllm-0.26.0* >/dev/null 2>&1 || W=$W bash "$SHARED/pack_vllm.sh"
  rm -rf .vllmsel .vllmparts && cp -r "$W/sel" .vllmsel
  parts+=(.vllmsel)
fi
PART_MIB=56 bash bench/pack_device_parts.sh "${parts[@]}"
du -sh .devparts
