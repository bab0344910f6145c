#!/usr/bin/env bash
# The one GPU entry point: named suites, run in the order given, on the lent machine from the repo
# root with .whl carried (../shared/tools/gpu-wheels.sh fills it):
#
#   bash benchmarks/gpu.sh SUITE [SUITE ...]
#
# Suites (each writes SUITE.md / SUITE.log, and JSON where the script makes one, into $OUT):
#   tests     pytest -m gpu tests/kernels (the Triton kernels against their torch twins), and the
#             unmarked kernel tests of the int8 modes, split_tokens and chunk invariance
#   kernels   benchmarks/attention.py --graphs (decode vs SDPA and the copy bandwidth, extend,
#             fidelity); KERNELS_ARGS adds flags (e.g. "--repeats 3")
#   variants  benchmarks/decode_variants.py (decode launch variants, checked then timed);
#             VARIANTS_ARGS adds flags (e.g. "--only old,bias-w4 --repeats 3")
#   ncu       benchmarks/ncu_decode.py --profile (Nsight Compute on _decode_stage1); NCU_CASES
#             overrides its cases
#   extend    benchmarks/extend_check.py (extend and cache-write kernels vs SDPA)
#   engine    pytest -m gpu tests/engine tests/model (graphs, parity through the Triton path), then
#             benchmarks/profile_step.py --steps 30 (one decode step of the Llama-1B shape, 256 rows)
#   offline   benchmarks/throughput.py --skip-hf (256 requests x 256 tokens, int8 and bf16 pages)
#   long      benchmarks/long_context.py (8B-class long-context work, memory ample and an 8 GiB
#             pool); LONG_ARGS adds flags (e.g. "--repeats 2")
#   fidelity  benchmarks/kv_fidelity.py --device cuda (greedy agreement, teacher-forced, KL)
#   seeds     benchmarks/seed_consistency.py (cold / cached / chunked / batch sizes on the GPU)
#   structured tests/kernels/test_triton_bitmask.py and tests/engine/test_structured.py on the GPU,
#             then benchmarks/structured.py (compile and mask-fill time, decode steps with token
#             masks against free ones: 64 and 256 rows, Qwen3-4B shape, 152k vocabulary)
# Add a suite as one more function and case arm below (engine, serving, tp, ...): one script,
# not one per issue. Each suite runs under `timeout`: TIMEOUT_<suite> seconds, else SUITE_TIMEOUT,
# else 300.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  source benchmarks/gpu_env.sh
else  # the kernel suites need no wheels when the machine has the service's packages
  OUT=${OUT:-/tmp/pie-gpu}; mkdir -p "$OUT"
  export PYTHONPATH=$PWD:$PWD/clients HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
fi
T=${SUITE_TIMEOUT:-300}
t() { local v="TIMEOUT_$1"; echo "${!v:-$T}"; }

suite_tests() {
  # the GPU-marked kernel tests, then the unmarked ones that exercise the int8 modes, split_tokens
  # and chunk invariance (on a GPU they run with bf16 queries and the PTX conversions)
  timeout "$(t tests)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tail -15 | tee "$OUT/tests.log"
  timeout "$(t tests)" python3 -m pytest -q -p no:cacheprovider tests/kernels -k "int8_modes or split_tokens or chunks_give" 2>&1 \
    | tail -15 | tee -a "$OUT/tests.log"
}
suite_kernels() {
  # shellcheck disable=SC2086
  timeout "$(t kernels)" python3 benchmarks/attention.py --graphs --out "$OUT/kernels.json" ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/kernels.md"
}
suite_variants() {
  # shellcheck disable=SC2086
  timeout "$(t variants)" python3 benchmarks/decode_variants.py --out "$OUT" ${VARIANTS_ARGS:-} 2>&1 | grep -v "^check" | tail -120
  grep -c "FAIL" "$OUT/variants.md" | sed 's/^/variants failing their check: /'
}
suite_ncu() {
  timeout "$(t ncu)" python3 benchmarks/ncu_decode.py --profile --out "$OUT" ${NCU_CASES:+--cases "$NCU_CASES"} 2>&1 | tee "$OUT/ncu.log"
}
suite_extend() { timeout "$(t extend)" python3 benchmarks/extend_check.py --out "$OUT" 2>&1 | tee "$OUT/extend.log" | tail -30; }
quiet() { grep -v '"event"\|engine_ready\|Writing model shards\|UserWarning\|_warn_once'; }
suite_engine() {
  timeout "$(t engine)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine tests/model 2>&1 | tail -12 | tee "$OUT/engine.log"
  timeout "$(t engine)" python3 benchmarks/profile_step.py --steps 30 2>&1 | quiet \
    | grep -v "^void\|nvjet\|^---\|Self CUDA" | tee -a "$OUT/engine.log" | grep -i "wall per\|forward\|median"
}
suite_offline() {
  timeout "$(t offline)" python3 benchmarks/throughput.py --skip-hf --out "$OUT/offline.json" 2>&1 | quiet | tail -9 | tee "$OUT/offline.md"
}
suite_long() {
  # shellcheck disable=SC2086
  timeout "$(t long)" python3 benchmarks/long_context.py --out "$OUT/long.json" ${LONG_ARGS:-} 2>&1 | quiet | tee "$OUT/long.md"
}
suite_fidelity() {
  timeout "$(t fidelity)" python3 benchmarks/kv_fidelity.py --device cuda --seeds 1 --exact-prefill 2>&1 | quiet | grep "^|" | tee "$OUT/fidelity.md"
}
suite_structured() {
  timeout "$(t structured)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_bitmask.py \
    tests/engine/test_structured.py 2>&1 | tail -8 | tee "$OUT/structured.log"
  timeout "$(t structured)" python3 benchmarks/structured.py --out "$OUT/structured.json" 2>&1 | quiet \
    | tee "$OUT/structured.md"
}
suite_seeds() {
  timeout "$(t seeds)" python3 benchmarks/seed_consistency.py 2>&1 | quiet | grep "^|" | tee "$OUT/seeds.md"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
[ $# -eq 0 ] && { grep '^#   [a-z]' "$0"; exit 2; }
for suite in "$@"; do
  echo "=== $suite ($(date -u +%H:%M:%S))"
  case $suite in
    tests|kernels|variants|ncu|extend|engine|offline|long|fidelity|seeds|structured) "suite_$suite" ;;
    *) echo "unknown suite: $suite"; exit 2 ;;
  esac
done
