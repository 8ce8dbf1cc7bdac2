#!/usr/bin/env bash
# GPU machine: the kernels written after run 22 without a GPU (the per-slot add + RMSNorm kernel,
# W_UK in the latent store's launch, a one-token MoE layer's shared experts on a second stream):
# their CUDA tests, then config M's decode step profiled against the tree ab_stage.sh staged
# (run 22's, d8ea79e: `tools/gpu_runs/ab_stage.sh d8ea79e` on the development machine first),
# then the decode kernels' CUDA tests. Logs: $OUT/t_*.log, $OUT/profile_{new,base}_1.*
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # name seconds pytest-args...
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/t_$name.log" 2>&1
  echo "$name rc $? $(tail -1 "$OUT/t_$name.log" | cut -c1-150) ($(( $(date +%s) - t0 )) s)"
  grep -E '^(FAILED|ERROR)|Error:|assert ' "$OUT/t_$name.log" | head -8 | cut -c1-300
}
run slot_latent 90 tests/test_slot_norm.py tests/test_latent_store.py
run moe 90 tests/test_moe_router.py -k "two_branches or shared_kernels_match or per_slot"
ROUNDS=${ROUNDS:-1} PER_RUN_S=60 timeout 200 bash tools/gpu_runs/ab_profile.sh 2>&1 | tail -8
for side in new base; do
  grep -E '_rope_latent_store|_add_slots|nvjet|triton_red|_gate_up|_down_kernel|_route|_gate_partial|_mla' \
    "$OUT/profile_${side}_1.log" | head -30 | sed "s/^/$side /"
done
echo "profiles ($(( $(date +%s) - t0 )) s)"
left=$(( ${CALL_S:-560} - ($(date +%s) - t0) ))
[ "$left" -gt 30 ] && run decode_kernels "$left" tests/test_decode_kernels.py -x -k "not smoke_on_cpu"
echo "total $(( $(date +%s) - t0 )) s"
