#!/usr/bin/env bash
# GPU machine: config M's decode step profiled on this tree ("new") and on the tree staged by
# ab_stage.sh ("base"), alternating, batch 1 and 64 unless BATCHES says (tools/profile_decode.py). Output:
# $OUT/profile_{new,base}_{1,2}.jsonl and the printed tables.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: the base side runs elsewhere
here=$PWD
base=$(bash tools/gpu_runs/ab_tree.sh) || exit 2
trap 'rm -rf "$base"' EXIT
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in new base; do
    dir=$here; [ "$side" = base ] && dir=$base
    (cd "$dir" && timeout "${PER_RUN_S:-90}" python3 tools/profile_decode.py --config "${CONFIG:-M}" \
        --batch "${BATCHES:-1,64}" --out "$OUT/profile_${side}_${round}.jsonl") \
      > "$OUT/profile_${side}_${round}.log" 2>&1
    echo "$side $round: rc $?"; grep -E '^\{' "$OUT/profile_${side}_${round}.log" \
      | python3 -c 'import json,sys
for l in sys.stdin:
    d=json.loads(l)
    if "batch" not in d: continue
    print("  batch %d: %d kernels, graph %.3f ms/step, bound %.3f" % (d["batch"], d["kernels_per_step"], d["graph_ms_per_step"], d["bound_ms_per_step"]))'
  done
done
