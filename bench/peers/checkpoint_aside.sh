#!/usr/bin/env bash
# Move the trained small checkpoint (36 MiB) out of the tree for a GPU lease, and back:
#   bash bench/peers/checkpoint_aside.sh out    # before the lease's device calls
#   bash bench/peers/checkpoint_aside.sh back   # after
# The device tool carries the working tree plus one part per call (64 MiB in all), so the checkpoint
# cannot travel with a 56 MiB part. Its files are marked skip-worktree while they are away, so that a
# commit made meanwhile (`git add -A` included) does not record them as deleted (session 23 did).
set -euo pipefail
cd "$(dirname "$0")/../.."
CK=models/checkpoints/small-v32
ASIDE=${ASIDE:-/tmp/small-v32-aside}
case "${1:?out or back}" in
  out)
    [ -d "$CK" ] || { echo "$CK is not here (already aside?)"; exit 1; }
    git ls-files -z "$CK" | xargs -0 git update-index --skip-worktree
    mv "$CK" "$ASIDE"
    echo "$CK -> $ASIDE (skip-worktree set)" ;;
  back)
    [ -d "$ASIDE" ] || { echo "$ASIDE is not there"; exit 1; }
    mkdir -p "$(dirname "$CK")"
    mv "$ASIDE" "$CK"
    git ls-files -z "$CK" | xargs -0 git update-index --no-skip-worktree
    git diff --quiet -- "$CK" && echo "$CK back, unchanged" ;;
  *) echo "out or back"; exit 2 ;;
esac
