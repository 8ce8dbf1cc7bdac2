#!/usr/bin/env bash
# GPU machine, from the repository root: build the tree ab_stage.sh staged (this tree with BASE's
# versions of the files that differ, BASE's absent ones removed) in a new temporary folder and
# print its path (the caller removes it). Used by ab_profile.sh and served_ab.sh.
set -euo pipefail
[ -d .devrun/ab ] || { echo "no .devrun/ab: run tools/gpu_runs/ab_stage.sh BASE first" >&2; exit 2; }
base=$(mktemp -d)
tar --exclude=./.devrun --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C "$base"
(cd .devrun/ab && tar --exclude=./BASE --exclude=./DELETED -cf - .) | tar -xf - -C "$base"
while read -r f; do [ -n "$f" ] && rm -f "$base/$f"; done < .devrun/ab/DELETED
echo "base = $(cat .devrun/ab/BASE)" >&2
echo "$base"
