#!/usr/bin/env bash
# GPU machine: served decode through tandem up + tandem bench next to the in-process step.
# Usage: tools/gpu_runs/served.sh S|M [extra tools/bench_serving_gpu.py flags, e.g. --mps]
# WAVES=N: N × concurrency requests a bench (default 2 ×): run 24 found one run's served figure
# within ±3 % (M) and ±7 % (S) of its repeats on one machine start at the default; an A/B of a
# smaller change needs more waves or more runs a side.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
cfg=${1:?usage: served.sh S|M [flags]}; shift
conc=64; [ "$cfg" = M ] && conc=1,64
# M's two workers on one 80 GB card: each holds 29.3 GiB of weights, and at the bench's 0.4 the
# decode worker's pool (2.0 GiB) is short of 64 streams' 1K + 256 tokens (2.4 GiB); at 0.44 each
# the decode worker ran out of memory while warming up (run 21, H100: it held 6.2 GiB beyond its
# share, the prefill worker 1 GiB). 0.41 each leaves 14 GiB of the card outside both shares.
if [ "$cfg" = M ] && [ -z "${TANDEM_MEM_FRACTION_STATIC:-}" ] && command -v nvidia-smi >/dev/null \
   && [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
  export TANDEM_MEM_FRACTION_STATIC=0.41
fi
tag=${TAG:-$(date +%H%M%S)}
timeout "${LIMIT_S:-560}" python3 tools/bench_serving_gpu.py --configs "$cfg" --contexts 1024 \
  --concurrency "${CONCURRENCY:-$conc}" --stream-interval 4 --output-tokens 256 --skip-transformers \
  --skip-exactness ${WAVES:+--waves "$WAVES"} --out "$OUT/serving_gpu_${cfg}_${tag}.json" "$@" 2>&1 | tail -40
