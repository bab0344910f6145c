#!/usr/bin/env bash
# One call on the lent GPU machine: the GPU-marked tests, then the kernel benchmark.
# Run from the repo root with .whl carried (../shared/tools/gpu-wheels.sh fills it):
#   bash benchmarks/gpu_check.sh [pytest selection...]
# Results land in $OUT (gpu_tests.log, attention.md, attention.json) when OUT is set.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
sel=("$@")
[ ${#sel[@]} -eq 0 ] && sel=(tests/kernels tests/engine)
python3 -m pytest -q -m gpu -p no:cacheprovider "${sel[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 benchmarks/attention.py --graphs --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.md"
# Issue 6's recorded GPU figures: prefix caching off/on and chunked vs whole prefill.
python3 benchmarks/scheduling.py 2>&1 | grep -v '"event"' | tee "$OUT/scheduling.md"
# Issue 5's offline throughput against transformers' continuous batching.
python3 benchmarks/throughput.py --out "$OUT/throughput.json" 2>&1 | grep -v '"event"' | tail -8 | tee "$OUT/throughput.md"
