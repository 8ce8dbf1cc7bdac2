# Sourced by the GPU-run scripts: `run NAME SECONDS PYTEST-ARGS...` runs pytest under a time limit,
# logs to $OUT/t_NAME.log and prints its result line and first failures, with the seconds since
# $t0 (the caller sets OUT and t0).
run() {
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/t_$name.log" 2>&1
  echo "$name rc $? $(tail -1 "$OUT/t_$name.log" | cut -c1-150) ($(( $(date +%s) - t0 )) s)"
  grep -E '^(FAILED|ERROR)|Error:|assert ' "$OUT/t_$name.log" | head -8 | cut -c1-300
}
