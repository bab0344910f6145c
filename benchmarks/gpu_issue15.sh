#!/usr/bin/env bash
# Issue 15 on the lent H200 (run from the repo root, .whl carried; the tree before issue 15 copied
# into .before/, untracked):  bash benchmarks/gpu_issue15.sh
# The GPU tests of the engine, kernels and model, then profile_step's decode step, after and before
# the change, interleaved. Results in $OUT: tests.log, profile.md.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ROOT=$PWD
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine tests/kernels tests/model 2>&1 | tail -30 > "$OUT/tests.log"
tail -5 "$OUT/tests.log"
for round in 1 2; do
  for tree in "$ROOT" "$ROOT/.before"; do
    [ -d "$tree" ] || continue
    echo "## $(basename "$tree") round $round" | tee -a "$OUT/profile.md"
    (cd "$tree" && PYTHONPATH=$ROOT/.site:$tree:$tree/clients timeout 90 python3 benchmarks/profile_step.py --steps 30 2>&1 \
      | grep -E "wall per decode|^\| (schedule|stage_inputs|forward|sample_and_sync|bookkeeping) " | tee -a "$OUT/profile.md")
  done
done
