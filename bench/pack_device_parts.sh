#!/usr/bin/env bash
# Split carried folders into parts small enough to travel beside the working tree (the device tool's
# 64 MiB per call counts the tracked tree, ~41 MiB with the trained small checkpoint, plus what is
# carried). Here, repo root (add /.devparts/ to .git/info/exclude):
#   PART_MIB=19 bash bench/pack_device_parts.sh .devicewheels/kernels .devicewheels/nixl .devicewheels/ray1 \
#       .devicewheels/ray2 .whl
# writes .devparts/pNN/part (one per device call). On the machine, one call per part, back to back
# (it stays warm ~30 s and /tmp survives): carry .devparts/pNN and run `bash bench/gpu_multi.sh stage`;
# then `bash bench/gpu_multi.sh install` unpacks and installs them all into /tmp/site in one pip command.
set -euo pipefail
D=${PARTS_DIR:-.devparts}  # another folder (also git-excluded) keeps a second set beside the first
rm -rf "$D" && mkdir -p "$D"
tar cf /tmp/devparts.tar "$@"
split -b "${PART_MIB:-19}m" -d -a 2 /tmp/devparts.tar /tmp/devparts.part
for f in /tmp/devparts.part*; do
  n=${f##*.part}; mkdir -p "$D/p$n"; mv "$f" "$D/p$n/part$n"
done
rm -f /tmp/devparts.tar
ls -la "$D"/*/
