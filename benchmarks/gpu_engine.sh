#!/usr/bin/env bash
# Issue 5's GPU figures in one call on the lent machine (run from the repo root, .whl carried):
#   bash benchmarks/gpu_engine.sh [tests|profile|host|throughput|capacity|serving ...]   (default: all)
# Results land in $OUT (or /tmp/pie-gpu): tests.log, profile.md, throughput.md/json, capacity.md,
# serving.md (six files: the device tool brings back at most eight).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
quiet() { grep -v '"event"\|engine_ready\|Writing model shards'; }
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests profile host throughput capacity serving)
for part in "${parts[@]}"; do
  case $part in
    tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/tests.log" | tail -6 ;;
    profile) timeout 150 python3 benchmarks/profile_step.py --steps 30 2>&1 | quiet | grep -v "^void\|nvjet\|^---\|Self CUDA\|UserWarning\|_warn_once" | tee "$OUT/profile.md" ;;
    # The engine's host work alone at 256 rows: the forward returns zeros at once (eager, async).
    host) timeout 120 python3 benchmarks/profile_step.py --micro --stub-forward --batch 256 --ctx 400 --steps 50 \
            --extra enforce_eager=true,async_scheduling=true 2>&1 | quiet | grep "wall per" | tee "$OUT/host.md" ;;
    throughput) timeout 300 python3 benchmarks/throughput.py ${SKIP_HF:+--skip-hf} --out "$OUT/throughput.json" 2>&1 | quiet | tail -9 | tee "$OUT/throughput.md" ;;
    # The pool, not the batch cap, limits the batch (3 GiB: ~166 int8 / ~85 bf16 sequences of 562 tokens).
    capacity) timeout 200 python3 benchmarks/throughput.py --skip-hf --kv-gib 3 --repeats 1 2>&1 | quiet | grep -v preempted | tail -5 | tee "$OUT/capacity.md" ;;
    serving)
      python3 -c 'import sys; sys.path.insert(0, "."); from pathlib import Path; import torch
from benchmarks.throughput import LLAMA_1B, build_model; Path("/tmp/llama1b").mkdir(exist_ok=True); build_model(Path("/tmp/llama1b"), LLAMA_1B, torch.bfloat16)' 2>&1 | quiet
      # the engine in its own process (with 1 and 4 tokens per message), then on a thread
      modes=("--engine-process" "--engine-process --stream-interval 4" "--no-engine-process")
      [ -n "${SERVING_MODE:-}" ] && modes=("$SERVING_MODE")  # one mode only
      for mode in "${modes[@]}"; do
        echo "## pie serve $mode" | tee -a "$OUT/serving.md"
        timeout 200 python3 benchmarks/serving.py --model /tmp/llama1b --server-args="--max-num-seqs 256 --max-num-batched-tokens 8192 $mode" \
          --concurrency ${SERVING_CONCURRENCY:-64,256} --requests 512 --prompt-len 300 --max-tokens 256 --vocab 32000 2>&1 | quiet | tail -8 | tee -a "$OUT/serving.md"
      done
      timeout 120 python3 benchmarks/throughput.py --skip-hf --kv int8 --requests 512 --min-prompt 300 --max-prompt 300 2>&1 | quiet | tail -3 | tee -a "$OUT/serving.md" ;;
  esac
done
