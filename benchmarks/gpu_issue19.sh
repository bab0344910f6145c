#!/usr/bin/env bash
# Issue 19 on a lent H200 (run from the repo root, .whl carried; the tree before tensor parallelism,
# commit c6b4c21, copied into .before/, untracked):  bash benchmarks/gpu_issue19.sh [tests] [profile] [throughput]
#   tests:      the engine, kernel and model GPU tests (the two-GPU NCCL ones skip on one GPU)
#   profile:    profile_step's decode step, after and before, interleaved, 3 rounds
#   throughput: throughput.py --skip-hf (Llama-3.2-1B shape, int8 pages), after and before, interleaved
# On nvidia-h200-x2 (two GPUs; no .before needed):
#   tp-tests:      the GPU tests of tensor parallelism and CUDA graphs, the two-GPU NCCL ones included
#   tp-speed:      the collectives of one decode step alone (tp_collectives.py), then throughput.py at
#                  N=1 and N=2 for the Llama-1B and 4B shapes (int8 pages, CUDA graphs)
# Results in $OUT: tests.log, profile.md, throughput.md, tp_tests.log, collectives.md, tp_throughput.md.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machines' rule: no NVLink multicast
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
  tp-tests)
    nvidia-smi topo -m | tee "$OUT/topo.txt"
    timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine/test_tensor_parallel.py \
      tests/engine/test_cuda_graphs.py tests/model/test_parallel.py 2>&1 | tail -30 > "$OUT/tp_tests.log"
    tail -8 "$OUT/tp_tests.log" ;;
  tp-speed)
    timeout 150 python3 benchmarks/tp_collectives.py --size 2 --out "$OUT/collectives.json" 2>&1 \
      | tee "$OUT/collectives.md" | tail -12
    for shape in llama-1b 4b; do
      for n in 1 2; do
        echo "## $shape N=$n" | tee -a "$OUT/tp_throughput.md"
        timeout 200 python3 benchmarks/throughput.py --skip-hf --kv int8 --repeats 3 --shape "$shape" \
          --tensor-parallel-size "$n" 2>&1 | tail -6 | tee -a "$OUT/tp_throughput.md"
      done
    done ;;
  *) echo "usage: $0 [tests] [profile] [throughput] [tp-tests] [tp-speed]" >&2; exit 2 ;;
esac
done
