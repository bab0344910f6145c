#!/usr/bin/env bash
# Issue 19 on a lent H200 (run from the repo root, .whl carried; the tree before tensor parallelism,
# commit c6b4c21, copied into .before/, untracked):  bash benchmarks/gpu_issue19.sh [tests] [profile] [throughput]
#   tests:      the engine, kernel and model GPU tests (the two-GPU NCCL ones skip on one GPU)
#   profile:    profile_step's decode step, after and before, interleaved, 3 rounds
#   throughput: throughput.py --skip-hf (Llama-3.2-1B shape, int8 pages), after and before, interleaved
# Results in $OUT: tests.log, profile.md, throughput.md.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
in_tree() {  # in_tree DIR CMD...: run CMD in DIR with that tree first on the import path
  local tree=$1; shift
  (cd "$tree" && PYTHONPATH=$ROOT/.site:$tree:$tree/clients "$@")
}
for part in "${@:-tests}"; do
case "$part" in
  tests)
    timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine tests/kernels tests/model 2>&1 \
      | tail -40 > "$OUT/tests.log"
    tail -12 "$OUT/tests.log" ;;
  profile)
    for round in 1 2 3; do
      for tree in "$ROOT" "$ROOT/.before"; do
        echo "## $( [ "$tree" = "$ROOT" ] && echo after || echo before ) round $round" | tee -a "$OUT/profile.md"
        in_tree "$tree" timeout 90 python3 benchmarks/profile_step.py --steps 30 2>&1 \
          | grep -E "wall per decode|^\| (schedule|stage_inputs|forward|sample_and_sync|bookkeeping) " | tee -a "$OUT/profile.md"
      done
    done ;;
  throughput)
    for round in 1 2; do
      for tree in "$ROOT" "$ROOT/.before"; do
        echo "## $( [ "$tree" = "$ROOT" ] && echo after || echo before ) round $round" | tee -a "$OUT/throughput.md"
        in_tree "$tree" timeout 200 python3 benchmarks/throughput.py --skip-hf --repeats 3 2>&1 | tail -12 \
          | tee -a "$OUT/throughput.md"
      done
    done ;;
  *) echo "usage: $0 [tests] [profile] [throughput]" >&2; exit 2 ;;
esac
done
