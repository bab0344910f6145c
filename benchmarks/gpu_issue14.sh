#!/usr/bin/env bash
# Issue 14's GPU figures (run from the repo root on the lent machine, .whl carried):
#   bash benchmarks/gpu_issue14.sh [tests|kernels|variants|llama|mixed ...]
# Results in $OUT: tests.log, attention.md/json, variants.md, llama.md, mixed.md/json.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
quiet() { grep -v '"event"\|engine_ready\|Writing model shards\|kv_smoothing\|warmed_up\|cuda_graphs_captured\|kv_cache_sized\|UserWarning\|warn('; }
for part in "$@"; do
  case $part in
    tests) timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -40 > "$OUT/tests.log"; tail -12 "$OUT/tests.log" ;;
    kernels) timeout 240 python3 benchmarks/attention.py --graphs --out "$OUT/attention.json" 2>&1 | quiet | tee "$OUT/attention.md" | tail -40 ;;
    variants) timeout 160 python3 benchmarks/decode_variants.py --engine 2>&1 | tee "$OUT/variants.md" | grep "BEST\|graph\|FAIL\|default" ;;
    llama) timeout 200 python3 benchmarks/throughput.py --skip-hf --repeats 3 2>&1 | quiet | tail -8 | tee "$OUT/llama.md" ;;
    mixed) timeout 300 python3 benchmarks/mixed.py --repeats 3 --out "$OUT/mixed.json" 2>&1 | quiet | tail -9 | tee "$OUT/mixed.md" ;;
  esac
done
