#!/usr/bin/env bash
# GPU machine, one call (about 560 s): what run 25 left unrun with programmatic dependent launch
# on, then the MLA decode kernel's launch shapes at batch 1, 2 and 4 timed in CUDA graphs.
# Needs the shipped checkpoint (tests/test_spec_batch.py) and .devrun's wheels: carry a .devrun
# without ab/ and without the py-spy wheel (checkpoint 40 MB + the rest of the tree + .devrun's
# wheels and etcd come to about 65 MB of the 67 a call may carry). Logs: $OUT/t_*.log,
# $OUT/mla_graph.jsonl and .log; then, in the time left, M's batch-1 step with inductor's own PDL
# off and on ($OUT/inductor_pdl_{0,1}.log).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
. tools/gpu_runs/pytest_run.sh  # run NAME SECONDS PYTEST-ARGS...
run pdl 120 tests/test_pdl.py
run spec 150 tests/test_spec_batch.py
run lane_edges 150 tests/test_model_lane.py tests/test_decode_edge_cases.py tests/test_device_clock.py
left=$(( ${CALL_S:-560} - ($(date +%s) - t0) ))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 tools/bench_mla_decode.py --graph --contexts 1024 --out "$OUT/mla_graph.jsonl" \
    > "$OUT/mla_graph.log" 2>&1
  echo "mla graph sweep rc $? ($(( $(date +%s) - t0 )) s)"; grep -E '^\|' "$OUT/mla_graph.log"
fi
# in the time left: inductor's own PDL for the compiled kernels between ours (README, next call 4)
if [ "$(( ${CALL_S:-560} - ($(date +%s) - t0) ))" -gt 150 ] \
   && python3 -c "import torch._inductor.config as c, sys; sys.exit(0 if hasattr(c.triton, 'enable_pdl') else 1)"; then
  for v in 0 1 0 1; do
    TORCHINDUCTOR_ENABLE_PDL=$v timeout 60 python3 tools/profile_decode.py --config M --batch 1 --top 5 \
      > "$OUT/inductor_pdl_$v.log" 2>&1
    echo "inductor PDL $v: $(grep -o '"graph_ms_per_step": [0-9.]*' "$OUT/inductor_pdl_$v.log")"
  done
fi
