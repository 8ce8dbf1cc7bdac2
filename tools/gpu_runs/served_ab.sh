#!/usr/bin/env bash
# GPU machine: served.sh on this tree ("new") or on the tree ab_stage.sh staged ("base"), so that
# a served figure that moved between two commits can be split from the machine it ran on (each
# side a call of its own, both on one machine start; the first served run of a start is slow,
# so run one side twice or quote the later). Flags go to this tree's served.sh, which runs the
# side's own tools/bench_serving_gpu.py: give only flags that BASE's takes.
# Usage: served_ab.sh new|base S|M [served.sh flags]
# Output: $OUT/serving_gpu_<cfg>_<side>_<time>.json and served.sh's table.
set -uo pipefail
side=${1:-}
case "$side" in new|base) shift ;; *) echo "usage: served_ab.sh new|base S|M [flags]"; exit 2 ;; esac
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); export OUT
here=$PWD
if [ "$side" = base ]; then
  base=$(bash tools/gpu_runs/ab_tree.sh) || exit 2
  trap 'rm -rf "$base"' EXIT
  # every process of the run imports the base tree: .devrun/setup.sh put this tree first
  new_path=""
  IFS=: read -r -a entries <<< "${PYTHONPATH:-}"
  for e in "${entries[@]}"; do
    [ "$e" = "$here" ] && e=$base
    new_path=${new_path:+$new_path:}$e
  done
  export PYTHONPATH=$new_path
  cd "$base" || exit 2
  python3 -c 'import engine, sys; sys.exit(0 if engine.__file__.startswith(sys.argv[1]) else 1)' "$base" \
    || { echo "the base side would import engine from elsewhere"; exit 2; }
fi
TAG=${side}_$(date +%H%M%S) bash "$here/tools/gpu_runs/served.sh" "$@"
