#!/usr/bin/env bash
# GPU machine: what the sampling features cost on the served path. Config S (or M) at
# concurrency 64 (CONCURRENCY) through served.sh, four runs in one call: greedy, sampled
# (--temperature 0.8, seeded per request), top log-probabilities (--top-logprobs 5), and both.
# The in-process figure of each row is the greedy step's; compare the served rows with each
# other. Usage: tools/gpu_runs/sampling_cost.sh [S|M] [served.sh flags, e.g. --mps]
# Output: $OUT/serving_gpu_<cfg>_sampling_<mode>.json and one table row per mode.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
cfg=${1:-S}; [ $# -gt 0 ] && shift
for mode in greedy sampled top both; do
  case $mode in
    greedy) flags=(--temperature 0) ;;
    sampled) flags=(--temperature 0.8) ;;
    top) flags=(--top-logprobs 5) ;;
    both) flags=(--temperature 0.8 --top-logprobs 5) ;;
  esac
  CONCURRENCY=${CONCURRENCY:-64} TAG=sampling_$mode LIMIT_S=${LIMIT_S:-140} \
    bash tools/gpu_runs/served.sh "$cfg" "$@" "${flags[@]}" | grep -E '^\| [SM] ' | sed "s/^/$mode /"
done
