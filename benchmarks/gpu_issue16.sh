#!/usr/bin/env bash
# Issue 16's GPU figures in one call (repo root on the lent machine, .whl carried); results in $OUT.
#   qwen:  the mixed workload on the Qwen3-4B shape: offline int8/bf16 (3 repeats), one user,
#          transformers on 128 requests, and through gRPC at 64 and 256 streams
#   llama: one user on the Llama-3.2-1B shape
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
quiet() { grep -v '"event"\|engine_ready\|Writing model shards\|kv_smoothing\|warmed_up\|cuda_graphs_captured\|kv_cache_sized\|Warning\|warn(\|Loading weights\|_attn_implementation'; }
for part in "$@"; do
  case $part in
    qwen) timeout 430 python3 benchmarks/mixed.py --repeats 3 --single --hf 128 --serve 64,256 --out "$OUT/qwen.json" 2>&1 | quiet | tee "$OUT/qwen.md" | tail -16 ;;
    llama) timeout 110 python3 benchmarks/mixed.py --shape llama-1b --kv int8 --repeats 1 --requests 32 --single --out "$OUT/llama.json" 2>&1 | quiet | tee "$OUT/llama.md" | tail -3 ;;
  esac
done
