#!/usr/bin/env bash
# A machine with 2 to 8 GPUs: the multi-GPU issue's measurements (Wide-EP decode, pipeline-parallel
# prefill), written before any such machine was lent. Parts, in order, each under its own time
# limit; PART=tests|ep|a2a|pp runs one (default: all, within CALL_S, 560 s). Logs and JSON under $OUT.
#   tests  the EP / PP tests on GPUs (tests/test_ep_pool.py, test_moe_ep.py, test_e2e_ep_served.py,
#          test_e2e_prefill_pipeline.py; their CUDA cases use the GPUs they find)
#   ep     tools/bench_ep.py --device cuda on config M (a seeded checkpoint written once to $CKPT,
#          default /tmp/tandem-M, about 45 s), EP 1, 2, 4, 8 up to the GPU count, each at
#          PER_GPU_BATCH (8) requests a GPU: per-GPU decode tok/s at the same per-GPU batch
#   a2a    tools/bench_ep_moe.py: one MoE layer of M's shape and a 256-expert top-8 one at EP = the
#          GPU count, time per call and the all-to-alls' share
#   pp     tools/bench_prefill.py --preset h200: TTFT at 32K and 128K tokens, PP 1, 2, 4 (up to the
#          GPU count), static and dynamic chunks
# DEVICE=cpu NGPU=2 SMOKE=1 runs the same parts on a CPU with small shapes (the script's own check).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
DEVICE=${DEVICE:-cuda}
t0=$(date +%s)
if [ "$DEVICE" = cuda ]; then
  n=${NGPU:-$(nvidia-smi -L | wc -l)}
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
else
  n=${NGPU:-2}
fi
sizes=""; for s in 1 2 4 8; do [ "$s" -le "$n" ] && sizes="$sizes${sizes:+ }$s"; done
echo "$n devices; EP / PP sizes: $sizes"
part=${PART:-all}
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - t0) )); }
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
note() { echo "$1 rc $2 ($(( $(date +%s) - t0 )) s)"; }
smoke=${SMOKE:-0}

if want tests; then
  timeout "$(( $(left) < 240 ? $(left) : 240 ))" python3 -m pytest -q -p no:cacheprovider \
    tests/test_ep_pool.py tests/test_moe_ep.py tests/test_e2e_ep_served.py tests/test_e2e_prefill_pipeline.py \
    > "$OUT/t_multi_gpu.log" 2>&1
  note tests $?; tail -1 "$OUT/t_multi_gpu.log"; grep -E '^(FAILED|ERROR)' "$OUT/t_multi_gpu.log" | head -8
fi

if want ep; then
  model=${MODEL:-}
  if [ -z "$model" ] && [ "$smoke" = 1 ]; then model=tandem-shakespeare; fi
  if [ -z "$model" ]; then
    model=${CKPT:-/tmp/tandem-M}
    if [ ! -f "$model/config.json" ]; then
      python3 -c "
import sys, torch; from pathlib import Path; sys.path.insert(0, 'tools')
from bench_serving_gpu import m_config, write_checkpoint
print('M parameters:', write_checkpoint(m_config(), Path('$model'), torch.device('cuda')))" 2>&1 | tail -2
    fi
  fi
  per=${PER_GPU_BATCH:-8}; ctx=${CONTEXT:-1024}; steps=${STEPS:-16}
  [ "$smoke" = 1 ] && { per=2; ctx=32; steps=4; }
  for e in $sizes; do
    [ "$(left)" -lt 60 ] && { echo "ep $e: no time left"; break; }
    timeout "$(left)" python3 tools/bench_ep.py --device "$DEVICE" --model "$model" --ep-sizes "$e" \
      --batch $(( per * e )) --context "$ctx" --steps "$steps" --out "$OUT/ep_$e.json" > "$OUT/ep_$e.log" 2>&1
    note "ep $e (batch $(( per * e )))" $?; tail -3 "$OUT/ep_$e.log"
  done
fi

if want a2a && [ "$n" -ge 2 ]; then
  dtype=bfloat16; [ "$DEVICE" = cpu ] && dtype=float32
  tokens=1,8,64,256; [ "$smoke" = 1 ] && tokens=1,16
  if [ "$smoke" = 1 ]; then shapes=("--hidden 128 --experts 8 --topk 2 --groups 2 --topk-groups 1 --moe-inter 64")
  else shapes=("--hidden 2048 --experts 64 --topk 6 --groups 8 --topk-groups 3 --moe-inter 1408"
               "--hidden 2048 --experts 256 --topk 8 --groups 8 --topk-groups 4 --moe-inter 1408"); fi
  i=0
  for shape in "${shapes[@]}"; do
    i=$(( i + 1 ))
    [ "$(left)" -lt 30 ] && break
    # shellcheck disable=SC2086  # the shape is several flags
    timeout "$(left)" python3 tools/bench_ep_moe.py --device "$DEVICE" --world "$n" --dtype "$dtype" $shape \
      --tokens "$tokens" --out "$OUT/ep_moe_$i.json" > "$OUT/ep_moe_$i.log" 2>&1
    note "a2a shape $i" $?; tail -4 "$OUT/ep_moe_$i.log"
  done
fi

if want pp; then
  cases=""; for s in $sizes; do [ "$s" -le 4 ] && cases="$cases${cases:+,}pp$s-static,pp$s-dynamic"; done
  if [ "$smoke" = 1 ]; then args=(--preset cpu --lengths 4096 --chunk 1024)
  else args=(--preset h200 --lengths "${LENGTHS:-32768,131072}"); fi
  [ "$(left)" -gt 60 ] && {
    timeout "$(left)" python3 tools/bench_prefill.py "${args[@]}" --device "$DEVICE" --cases "$cases" \
      --out "$OUT/pp.json" > "$OUT/pp.log" 2>&1
    note "pp ($cases)" $?; grep -E '"ttft_s"|error' "$OUT/pp.log" | cut -c1-200 | head -12; }
fi
echo "total $(( $(date +%s) - t0 )) s"
