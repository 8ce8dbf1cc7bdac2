#!/usr/bin/env bash
# GPU machine with two GPUs: S and M at concurrency 64 with the prefill worker on cuda:1 (decode
# alone on cuda:0, as deployed disaggregated), each next to both workers on one GPU under --mps.
# The KV then moves between two devices (cuda-ipc): if this fails, that copy is the first suspect.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
for cfg in S M; do
  for mode in split mps; do
    flags=(--prefill-device cuda:1); [ "$mode" = mps ] && flags=(--mps)
    timeout 130 python3 tools/bench_serving_gpu.py --configs "$cfg" --contexts 1024 --concurrency 64 \
      --stream-interval 4 --output-tokens 256 --skip-transformers --skip-exactness \
      --out "$OUT/serving_gpu_${cfg}_${mode}.json" "${flags[@]}" > "$OUT/two_gpus_${cfg}_${mode}.log" 2>&1
    echo "$cfg $mode: rc $?"; tail -4 "$OUT/two_gpus_${cfg}_${mode}.log"
  done
done
