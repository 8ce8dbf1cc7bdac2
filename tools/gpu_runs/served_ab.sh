#!/usr/bin/env bash
# GPU machine: served.sh on this tree ("new") or on the tree ab_stage.sh staged ("base"), so that
# a served figure that moved between two commits can be split from the machine it ran on (each
# side a call of its own, both on one machine start; the first served run of a start is slow,
# so run one side twice or quote the later). Usage: served_ab.sh new|base S|M [served.sh flags]
# Output: $OUT/serving_gpu_<cfg>_<side>_<time>.json and served.sh's table.
set -uo pipefail
side=${1:?usage: served_ab.sh new|base S|M [flags]}; shift
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); export OUT
here=$PWD
if [ "$side" = base ]; then
  [ -d .devrun/ab ] || { echo "no .devrun/ab: run tools/gpu_runs/ab_stage.sh BASE first"; exit 2; }
  base=$(mktemp -d)
  tar --exclude=./.devrun --exclude=./.git -cf - . | tar -xf - -C "$base"
  (cd .devrun/ab && tar --exclude=./BASE --exclude=./DELETED -cf - .) | tar -xf - -C "$base"
  while read -r f; do [ -n "$f" ] && rm -f "$base/$f"; done < .devrun/ab/DELETED
  echo "base = $(cat .devrun/ab/BASE)"
  # every process of the run imports the base tree (.devrun/setup.sh put this tree first)
  export PYTHONPATH=${PYTHONPATH//$here/$base}
  cd "$base" || exit 2
fi
TAG=${side}_$(date +%H%M%S) bash "$here/tools/gpu_runs/served.sh" "$@"
