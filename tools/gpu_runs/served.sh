#!/usr/bin/env bash
# GPU machine: served decode through tandem up + tandem bench next to the in-process step.
# Usage: tools/gpu_runs/served.sh S|M [extra tools/bench_serving_gpu.py flags, e.g. --mps]
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
cfg=${1:?usage: served.sh S|M [flags]}; shift
conc=64; [ "$cfg" = M ] && conc=1,64
tag=${TAG:-$(date +%H%M%S)}
timeout "${LIMIT_S:-560}" python3 tools/bench_serving_gpu.py --configs "$cfg" --contexts 1024 \
  --concurrency "${CONCURRENCY:-$conc}" --stream-interval 4 --output-tokens 256 --skip-transformers \
  --skip-exactness --out "$OUT/serving_gpu_${cfg}_${tag}.json" "$@" 2>&1 | tail -40
