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

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
[ $# -eq 0 ] && { grep '^#   [a-z]' "$0"; exit 2; }
for suite in "$@"; do
  echo "=== $suite ($(date -u +%H:%M:%S))"
  case $suite in
    tests|kernels|variants|ncu|extend) "suite_$suite" ;;
    *) echo "unknown suite: $suite"; exit 2 ;;
  esac
done
