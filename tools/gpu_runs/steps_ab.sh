#!/usr/bin/env bash
# GPU machine: served decode at several --decode-steps-per-launch values, alternating, in one call.
# Usage: tools/gpu_runs/steps_ab.sh S|M N [N ...] [-- extra served.sh flags, e.g. --mps]
# e.g. tools/gpu_runs/steps_ab.sh S 2 1 2 1 -- --mps   (each S run 75-150 s: the first on a machine compiles)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
cfg=${1:?usage: steps_ab.sh S|M N [N ...] [-- flags]}; shift
values=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do values+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
t0=$(date +%s)
for i in "${!values[@]}"; do
  n=${values[$i]}
  TANDEM_DECODE_STEPS_PER_LAUNCH=$n TAG="steps${n}_$i" bash "$(dirname "$0")/served.sh" "$cfg" "$@" \
    > "$OUT/served_${cfg}_steps${n}_$i.log" 2>&1
  echo "$cfg steps per launch $n (run $i): rc $? ($(( $(date +%s) - t0 )) s)"
  grep -E "^\| $cfg " "$OUT/served_${cfg}_steps${n}_$i.log"
done
