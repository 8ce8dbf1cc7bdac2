#!/usr/bin/env bash
# The CUDA tests of the decode path's kernels and steps, each file under its own time limit so
# that one slow file does not use up the call. Logs: $OUT/check_<file>.log.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
files=(tests/test_latent_store.py tests/test_greedy_head.py tests/test_moe_router.py tests/test_decode_kernels.py
       tests/test_device_clock.py tests/test_model_lane.py tests/test_spec_batch.py
       tests/test_overlap_cuda.py tests/test_decode_edge_cases.py)
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  log="$OUT/check_$(basename "$f" .py).log"
  timeout "${PER_FILE_S:-120}" python3 -m pytest -q -x -p no:cacheprovider "$f" >"$log" 2>&1
  echo "$f: rc $? $(tail -1 "$log")"
done
