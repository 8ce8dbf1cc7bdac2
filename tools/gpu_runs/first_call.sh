#!/usr/bin/env bash
# One device call (~520 s), what run 19 (one H100, 2026-12-05) left open: the overlap loop's CUDA
# tests after the review's changes to its planning, a CUDA test file that ran out of its 70 s
# there (mostly compiling), then S served under MPS at 2 and 1 decode steps per launch,
# alternating, on this machine (run 19 measured it on an H100 only). test_spec_batch: check.sh.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
run() { local name=$1 limit=$2; shift 2; timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1; echo "$name rc $? ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/$name.log")"; }
run t_overlap_cuda 120 tests/test_overlap_cuda.py
run t_model_lane 100 tests/test_model_lane.py
LIMIT_S=150 bash tools/gpu_runs/steps_ab.sh S 2 1 -- --mps
echo "total $(( $(date +%s) - t0 )) s"
