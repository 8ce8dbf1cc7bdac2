#!/usr/bin/env bash
# GPU machine: kernels written without a GPU, checked and measured on one: their CUDA tests, then
# config M's decode step profiled against the tree ab_stage.sh staged (on the development machine
# first: `tools/gpu_runs/ab_stage.sh BASE`, BASE the commit before the kernels), then the decode
# kernels' CUDA tests in the time left (CALL_S=1: none). Run 24 checked W_UV inside the MLA
# splits' merge this way (branch uv-in-merge, BASE main: slower, not merged); run 23 checked
# the per-slot add + RMSNorm, W_UK in the latent store and the branched MoE layer (BASE d8ea79e). Tests that a tree lacks select nothing.
# TESTS="tests/a.py tests/b.py" runs those first instead of the MLA tests (branch decode-gemv:
# TESTS="tests/test_small_gemv.py tests/test_pdl.py").
# Logs: $OUT/t_*.log, $OUT/profile_{new,base}_1.*
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
. tools/gpu_runs/pytest_run.sh  # run NAME SECONDS PYTEST-ARGS...
# TESTS: the new kernels' tests (default: the MLA kernels' and W_UV's)
if [ -n "${TESTS:-}" ]; then
  run new_kernels 150 $TESTS
else
  run mla 120 tests/test_decode_kernels.py $(ls tests/test_mla_uv_merge.py 2>/dev/null) -k "w_uv or mla_decode_kernel or merge"
fi
ROUNDS=${ROUNDS:-1} PER_RUN_S=80 BATCHES=${BATCHES:-1,2,4,64} timeout 240 bash tools/gpu_runs/ab_profile.sh 2>&1 | tail -8
for side in new base; do
  grep -E '_mla|nvjet|_add_slots|triton_red|_gemv|_route|_gate_partial' "$OUT/profile_${side}_1.log" | head -30 | sed "s/^/$side /"
done
echo "profiles ($(( $(date +%s) - t0 )) s)"
left=$(( ${CALL_S:-560} - ($(date +%s) - t0) ))
[ "$left" -gt 30 ] && run decode_kernels "$left" tests/test_decode_kernels.py -x -k "not smoke_on_cpu"
echo "total $(( $(date +%s) - t0 )) s"
