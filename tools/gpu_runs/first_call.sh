#!/usr/bin/env bash
# One device call (~420 s), what run 20 (one H100, 2026-12-05) left open:
# 1. the overlap loop's CUDA tests with 4 decode steps per launch (the new default: graphs
#    replayed 4 times back to back);
# 2. why the first served run after a machine starts is slow whatever N (run 20: TTFT 780-820 ms
#    against 220-280, prefill device ms a request 7.7-7.9 against 4.8-6.2): S served once cold
#    with py-spy on the decode worker, the router and the prefill worker
#    (--profile-decode-host; py-spy from .devrun/py-spy.xz when it is there), then once warm;
# Then M at the new default, one run a call (served.sh gives its two workers 0.41 of an 80 GB card
# each: 0.44 ran out of memory in run 21):
#   CONCURRENCY=64 LIMIT_S=560 bash tools/gpu_runs/served.sh M --mps
#   TANDEM_DECODE_STEPS_PER_LAUNCH=1 CONCURRENCY=64 LIMIT_S=560 bash tools/gpu_runs/served.sh M --mps
# (M's first run on a machine is cold too: compare M runs only after one M run on it.)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if ! command -v py-spy >/dev/null && [ -f .devrun/py-spy.xz ]; then
  mkdir -p /tmp/pybin && xz -dc .devrun/py-spy.xz > /tmp/pybin/py-spy && chmod +x /tmp/pybin/py-spy
  export PATH="/tmp/pybin:$PATH"
fi
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_overlap_cuda.py > "$OUT/t_overlap_cuda.log" 2>&1
echo "t_overlap_cuda rc $? ($(( $(date +%s) - t0 )) s): $(grep -E 'passed|failed' "$OUT/t_overlap_cuda.log" | tail -1)"
profile=(); command -v py-spy >/dev/null && profile=(--profile-decode-host 30)
LIMIT_S=170 TAG=cold bash tools/gpu_runs/served.sh S --mps "${profile[@]}" > "$OUT/served_S_cold.log" 2>&1
echo "S cold: rc $? ($(( $(date +%s) - t0 )) s)"; grep -E "^\| S " "$OUT/served_S_cold.log"
LIMIT_S=120 TAG=warm bash tools/gpu_runs/served.sh S --mps > "$OUT/served_S_warm.log" 2>&1
echo "S warm: rc $? ($(( $(date +%s) - t0 )) s)"; grep -E "^\| S " "$OUT/served_S_warm.log"
echo "total $(( $(date +%s) - t0 )) s"
