#!/usr/bin/env bash
# Every GPU check in one go (scripts/gpu_check.py; see docs/gpu.md).  Results go to
# runs/gpu-check (or $GPU_CHECK_OUT).  Where $OUT is set (a device machine that returns a few
# files), summary.md, summary.json and gpu_check.tgz (the whole folder, rewritten after every
# check, so a run cut short still returns what finished) are written there too.
#   scripts/gpu_check.sh                      # the GPU run, 600 s budget
#   scripts/gpu_check.sh --budget-s 420       # any gpu_check.py option passes through
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-runs/gpu-check}"
extra=()
if [ -n "${OUT:-}" ]; then
  extra=(--archive "$OUT/gpu_check.tgz")
fi
python3 scripts/gpu_check.py --out "$out" "${extra[@]}" "$@"
rc=$?
if [ -n "${OUT:-}" ]; then
  cp "$out/summary.md" "$out/summary.json" "$OUT/" 2>/dev/null || true
fi
exit "$rc"
