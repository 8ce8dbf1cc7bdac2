#!/usr/bin/env bash
# GPU machine: profiled on this tree ("new") and on the tree staged by ab_stage.sh ("base"),
# alternating, ROUNDS rounds (2):
#   WHAT=decode (default): config M's decode step, batch 1 and 64 unless BATCHES says
#     (tools/profile_decode.py); output $OUT/profile_{new,base}_{round}.jsonl and .log;
#   WHAT=prefill: one batched prefill forward as a served run at concurrency 64 makes them
#     (PREFILL_BATCH, default 9:512:512: 9 prompts of 1,024 tokens, half of each cached;
#     tools/profile_prefill.py --batch, seeded weights drawn on the GPU, no checkpoint), wall ms
#     and kernels a forward; output $OUT/profile_prefill_{CONFIG}_{new,base}_{round}.jsonl and .log.
# CONFIG picks S or M (M).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: the base side runs elsewhere
here=$PWD
what=${WHAT:-decode}
case "$what" in
  decode) name=profile; cmd=(python3 tools/profile_decode.py --config "${CONFIG:-M}" --batch "${BATCHES:-1,64}") ;;
  prefill) name=profile_prefill_${CONFIG:-M}; cmd=(python3 tools/profile_prefill.py --config "${CONFIG:-M}" --no-ops
                                       --batch "${PREFILL_BATCH:-9:512:512}") ;;
  *) echo "WHAT must be decode or prefill, got $what"; exit 2 ;;
esac
base=$(bash tools/gpu_runs/ab_tree.sh) || exit 2
trap 'rm -rf "$base"' EXIT
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in new base; do
    dir=$here; [ "$side" = base ] && dir=$base
    (cd "$dir" && timeout "${PER_RUN_S:-90}" "${cmd[@]}" --out "$OUT/${name}_${side}_${round}.jsonl") \
      > "$OUT/${name}_${side}_${round}.log" 2>&1
    echo "$side $round: rc $?"; grep -E '^\{' "$OUT/${name}_${side}_${round}.log" \
      | python3 -c 'import json,sys
for l in sys.stdin:
    d=json.loads(l)
    if "kernels_per_step" in d:
        print("  batch %d: %d kernels, graph %.3f ms/step, bound %.3f" % (d["batch"], d["kernels_per_step"], d["graph_ms_per_step"], d["bound_ms_per_step"]))
    elif "kernels" in d and "ms" in d:
        print("  %d x (%d cached + %d new), %s: %.3f ms, %d kernels" % (d["batch"], d["prefix"], d["suffix"], d["attention"], d["ms"], d["kernels"]))'
  done
done
