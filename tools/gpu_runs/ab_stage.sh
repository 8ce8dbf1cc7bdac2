#!/usr/bin/env bash
# Development machine: stage commit BASE's files that differ from the working tree (all but docs/
# and tests/) into .devrun/ab/ (see README.md). Usage: tools/gpu_runs/ab_stage.sh BASE
set -euo pipefail
base=${1:?usage: ab_stage.sh BASE_COMMIT}
top=$(git rev-parse --show-toplevel); cd "$top"
rm -rf .devrun/ab && mkdir -p .devrun/ab
: > .devrun/ab/DELETED
# --no-renames: a file renamed since BASE is listed under both names (its old one staged, its new
# one deleted); -z: paths as they are, unquoted
git diff --no-renames --name-only -z "$base" -- . ':!docs' ':!tests' | while IFS= read -r -d '' f; do
  if git cat-file -e "$base:$f" 2>/dev/null; then
    mkdir -p ".devrun/ab/$(dirname "$f")" && git show "$base:$f" > ".devrun/ab/$f"
  else
    echo "$f" >> .devrun/ab/DELETED
  fi
done
git rev-parse "$base" > .devrun/ab/BASE
echo "staged $(find .devrun/ab -type f ! -name DELETED ! -name BASE | wc -l) files of $base; absent there: $(wc -l < .devrun/ab/DELETED)"
