#!/usr/bin/env bash
# One device call (~590 s): the CUDA tests of what changed since the last GPU run (latent store,
# greedy head, listed MoE routing, MLA decode and graphs), then M's decode profile on this tree
# and on the tree ab_stage.sh staged (run `tools/gpu_runs/ab_stage.sh dab9b85` first), one round.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$(date +%s)
run() { local name=$1 limit=$2; shift 2; timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1; echo "$name rc $? ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/$name.log")"; }
run t_latent_greedy 130 tests/test_latent_store.py tests/test_greedy_head.py
run t_router 130 tests/test_moe_router.py -k "route_grouped or one_token or moe_router or rope"
run t_decode 140 tests/test_decode_kernels.py -k "mla or graph or greedy or absorbed or one_token"
ROUNDS=1 PER_RUN_S=95 BATCHES=1,64 bash tools/gpu_runs/ab_profile.sh
echo "total $(( $(date +%s) - t0 )) s"
