#!/usr/bin/env bash
# GPU machine: what top log-probabilities cost an MTP k = 2 decode step, in-process and served.
# 1. tools/bench_spec_step.py: the step as the worker's overlap loop runs it, every row asking
#    for 0 and for 5 alternatives, batch 1 and 8 (host ms per launch: what bounds the loop);
# 2. the served run at concurrency 1 with --top-logprobs 5, py-spy on the decode worker and the
#    router (py-spy on PATH, or .devrun/py-spy.xz: the binary xz-compressed), and the same without
#    --top-logprobs (run 27: 0.358 → 0.825 ms TPOT at concurrency 1). Fits one 560 s call.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
t0=$(date +%s)
if ! command -v py-spy >/dev/null && [ -f .devrun/py-spy.xz ]; then
  mkdir -p /tmp/pybin && xz -dc .devrun/py-spy.xz > /tmp/pybin/py-spy && chmod +x /tmp/pybin/py-spy
  export PATH="/tmp/pybin:$PATH"
fi
profile=(); command -v py-spy >/dev/null && profile=(--profile-decode-host 20)
timeout 140 python3 tools/bench_spec_step.py --ks 2 --batch 1,8 --top-logprobs 0,5 --steps 100 \
  --out "$OUT/spec_step_tops.json" 2>&1 | grep "^|\|rror"
for t in 5 0; do
  left=$(( 560 - ($(date +%s) - t0) ))
  [ "$left" -gt 60 ] || break
  timeout $(( left > 200 ? 200 : left )) python3 tools/bench_serving_gpu.py --configs '' --mtp 2 --mtp-concurrency 1 \
    --output-tokens 128 --top-logprobs "$t" "${profile[@]}" --out "$OUT/mtp_tops${t}.json" 2>&1 | tail -3
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for t in (5, 0):
    p = pathlib.Path(sys.argv[1]) / f"mtp_tops{t}.json"
    for r in (json.loads(p.read_text()).get("mtp", []) if p.exists() else []):
        print(f"--- top_logprobs={t}", {k: r.get(k) for k in ("concurrency", "tpot_ms", "accept_length")})
        for key in ("host_profile", "router_host_profile"):
            for name, th in ((r.get(key) or {}).get("threads") or {}).items():
                print(f"  {key} {name}: {th.get('ms_per_step')} ms a step")
                for f in th.get("functions", [])[:25]:
                    print("     ", f)
PY
