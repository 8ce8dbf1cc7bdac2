#!/usr/bin/env bash
# One device call (~540 s), what run 20 (one H100, 2026-12-05) left open: the overlap loop's CUDA
# tests with 4 decode steps per launch (the new default; graphs replayed 4 times back to back),
# then M served under MPS at concurrency 64 at the default (M was never served with several
# steps per launch). M's two workers on one GPU want an H200 (needs_h200: an H100's 80 GB barely
# holds both workers' 31 GB of weights). The same at N = 1 for the A/B: a second call,
# `TANDEM_DECODE_STEPS_PER_LAUNCH=1 CONCURRENCY=64 LIMIT_S=560 bash tools/gpu_runs/served.sh M --mps`.
# The first served run after a machine starts is slow whatever N (run 20: cold compile caches):
# compare only runs after the first of a machine start.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_overlap_cuda.py > "$OUT/t_overlap_cuda.log" 2>&1
echo "t_overlap_cuda rc $? ($(( $(date +%s) - t0 )) s): $(grep -E 'passed|failed' "$OUT/t_overlap_cuda.log" | tail -1)"
CONCURRENCY=64 LIMIT_S=400 TAG=steps4 bash tools/gpu_runs/served.sh M --mps > "$OUT/served_M_steps4.log" 2>&1
echo "M steps per launch 4: rc $? ($(( $(date +%s) - t0 )) s)"
grep -E "^\| M " "$OUT/served_M_steps4.log"
echo "total $(( $(date +%s) - t0 )) s"
