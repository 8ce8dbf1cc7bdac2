#!/usr/bin/env bash
# One device call (~560 s): what run 18 (one H100, 2026-12-05) left open. The latent kernel's
# CUDA tests after its rounding fix and which rounding it follows (latent_rounding.py), the
# decode-step tests that ran out of time there, then the rest of the kernels' CUDA tests.
# (Run 18 already measured M's step against dab9b85: ab_profile.sh, docs/benchmarks.md.)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$(date +%s)
run() { local name=$1 limit=$2; shift 2; timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1; echo "$name rc $? ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/$name.log")"; }
run t_latent 120 tests/test_latent_store.py
timeout 100 python3 tools/gpu_runs/latent_rounding.py > "$OUT/latent_rounding.log" 2>&1; echo "latent_rounding rc $?"; tail -12 "$OUT/latent_rounding.log"
run t_decode 300 tests/test_decode_kernels.py -k "mla or graph or greedy or absorbed or one_token or mixed"
echo "total $(( $(date +%s) - t0 )) s"
