#!/usr/bin/env bash
# The one GPU entry point: named suites, run in the order given, on the lent machine from the repo
# root with .whl carried (../shared/tools/gpu-wheels.sh fills it):
#
#     bash benchmarks/gpu.sh SUITE [SUITE ...]
#     BASELINE=<commit> [ROUNDS=N] bash benchmarks/gpu.sh SUITE [SUITE ...]
#
# Suites (each writes SUITE.md or SUITE.log, and JSON where the script makes one, into $OUT):
#   tests       pytest -m gpu tests/kernels (the Triton kernels against their torch twins), and the
#               unmarked kernel tests of the int8 modes, split_tokens, chunk invariance and the decode
#               kernel's options (min_split, sub-tiles)
#   alltests    pytest -m gpu tests: every GPU-marked test (kernels, engine, model, tensor parallel); a
#               call of its own (its time limit 570 s)
#   kernels     benchmarks/attention.py --graphs (decode vs SDPA and the copy bandwidth, extend,
#               fidelity); KERNELS_ARGS adds flags (e.g. "--repeats 3")
#   variants    benchmarks/decode_variants.py (decode launch variants, checked then timed);
#               VARIANTS_ARGS adds flags (e.g. "--only old,bias-w4 --repeats 3", "--one-stream")
#   ncu         benchmarks/ncu_decode.py --profile (Nsight Compute on _decode_stage1); NCU_CASES
#               overrides its cases
#   roofline    benchmarks/int8_roofline.py --stream --buildup (issue 46: the streaming kernels, the
#               decode build-up step by step beside the shipped kernel; ~5-8 minutes, its own budget
#               ends the sweeps in time, so give it a call of its own); ROOFLINE_ARGS replaces those
#               flags (e.g. "--ncu --best PATH/roofline.json", "--buildup --steps step5-imma")
#   extend      benchmarks/extend_check.py (extend and cache-write kernels vs SDPA)
#   engine      pytest -m gpu tests/engine tests/model (graphs, parity through the Triton path), then
#               the profile suite
#   profile     benchmarks/profile_step.py --steps 30 (one decode step of the Llama-1B shape, 256 rows,
#               int8 pages; the phases synchronized); the figure a before/after comparison reads.
#               PROFILE_ARGS adds flags: "--prompt-tokens 512" makes each step a mixed one, and its
#               last line says how much of the step the host left the GPU idle; "--pin-gpu-node"
#               keeps the host on the GPU's NUMA node (its `host:` line says where a run was); "--shape
#               4b --batch 1" is one stream of the Qwen3-4B shape (profile.md keeps the top kernels)
#   host        benchmarks/profile_step.py --micro --stub-forward --batch 256 (the engine's host work
#               per step alone: the forward returns zeros at once)
#   offline     benchmarks/throughput.py --skip-hf (256 requests x 256 tokens, int8 and bf16 pages);
#               OFFLINE_ARGS adds flags (e.g. "--repeats 3", "--shape 4b")
#   hf          benchmarks/throughput.py with transformers' generate_batch on the same workload
#   capacity    benchmarks/throughput.py --skip-hf --kv-gib 3: the KV pool, not the batch cap, limits
#               the batch (int8 against bf16 pages, preemptions counted)
#   serving     pie serve on the Llama-1B shape under benchmarks/serving.py at 64 and 256 streams,
#               engine process (1 and 4 tokens per message) and thread, then the offline engine on
#               the same requests; SERVING_MODE runs one server mode, SERVING_CONCURRENCY other levels
#   mixed       benchmarks/mixed.py --repeats 3 --single --hf 128 --serve 64,256 (the Qwen3-4B shape's
#               mixed workload: offline, one user, transformers, gRPC); MIXED_ARGS replaces those
#               flags (one user on the Llama-1B shape:
#               MIXED_ARGS="--shape llama-1b --kv int8 --repeats 1 --requests 32 --single")
#   long        benchmarks/mixed.py --workload long (8B-class long-context work, memory ample and an
#               8 GiB pool); LONG_ARGS adds flags (e.g. "--repeats 2")
#   chat        benchmarks/mixed.py --workload chat (the Qwen2-7B shape: multi-turn chat in a pool a
#               quarter of the working set, KV tiers off / host / host+disk, int8 and bf16 pages);
#               CHAT_ARGS adds flags: a smaller work, still a quarter in the pool, "--conversations 32
#               --turns 4 --in-flight 3 --reply-len 32" (~20 s a run on an H100; its short replies
#               leave prefill a smaller share than the defaults' 768 turns of 128 tokens, ~1 min a run)
#   fidelity    benchmarks/kv_fidelity.py --device cuda (greedy agreement, teacher-forced, KL)
#   smolpart    copies the carried .smol/part-N (tests/smollm2.py --split .smol) aside into
#               .smol_keep/, where it stays while the machine is held: one part a call, carry
#               [".whl", ".smol/part-N"] (benchmarks/README.md, the real checkpoint on the GPU)
#   realfidelity  benchmarks/kv_fidelity.py --real --device cuda on SmolLM2-135M-Instruct, built from
#               the parts in .smol_keep/ (the GGUF's SHA-256 checked; the gguf wheel in .whl)
#   seeds       benchmarks/seed_consistency.py (cold / cached / chunked / batch sizes on the GPU);
#               SEEDS_ARGS adds flags (e.g. "--batch-invariant", "--shape qwen2-7b")
#   structured  tests/kernels/test_triton_bitmask.py and tests/engine/sample/test_structured.py on the GPU,
#               then benchmarks/structured.py (compile and mask-fill time, decode steps with token
#               masks against free ones: 64 and 256 rows, Qwen3-4B shape, 152k vocabulary)
#   tp          tensor parallelism: its GPU tests (the NCCL ones need 2 GPUs), throughput at N=1 and,
#               with 2+ GPUs, N=2 (Llama-1B and 4B shapes, int8 pages)
#   spec        benchmarks/speculative.py --only cost,speed (issue 32, Llama-1B shape, int8 pages): one
#               engine step with K = 0..8 proposals per row at batch 1, 8, 64, and decode tok/s against
#               a of K accepted (K = 4, 8) at batch 1, 8, 64, 256, the default speculative_max_batch and
#               speculation forced on; rows starting after SPEC_BUDGET_S (default 200) s are skipped, so
#               the suite ends within 5 minutes; SPEC_ARGS adds flags (e.g. "--shape 4b")
#   lora        benchmarks/lora_kernels.py (issue 61): the LoRA kernels (shrink, reduce, expand) beside
#               the base projections they ride on, per projection and per step, at a decode batch
#               and a prefill chunk, per launch variant; LORA_ARGS adds flags (e.g. "--variants chunks,gemm", "--slots 1,8,32")
#   gemv        benchmarks/gemv.py (issue 64): one row through each projection, cuBLAS against the Triton
#               matrix-vector kernel's launch configs (Llama-1B and Qwen3-4B shapes); GEMV_ARGS adds flags
#               (e.g. "--shapes qwen2-7b --configs 16x512x1,8x256x4")
#   ab          benchmarks/ab.py: the A/B gate, this tree against each base tree carried in .ab/
#               (`git archive <commit> | tar -x -C .ab/<commit>` here, then carry [".whl", ".ab"]) on
#               the 7B-class long work at the defaults, alternating rounds; AB_ARGS adds flags
#               (default "--mode quick --rounds 3"; "--mode full" for every row); AB_BASES names the
#               folders under .ab/ to compare with, one at a time (default: all of them; "-": none,
#               for AB_ARGS="--variant batch_invariant=true ...", a setting against the defaults);
#               "--resume .ab/ab-BASE.json" (an earlier call's JSON, carried) runs only what it lacks
#   aiperf      benchmarks/aiperf_http.py: aiperf against `pie serve --http-port` on the Llama-1B shape
#               (the bundled tokenizer's vocabulary, bf16, int8 pages) at 16, 64 and 256 concurrent
#               streams, 300 prompt tokens and 256 out; aiperf's wheels the machine lacks are carried
#               in .whl-aiperf (`bash benchmarks/gpu_prep.sh --aiperf`) and go into .site-aiperf, beside
#               .site, which an earlier call on the held machine installed (benchmarks/README.md says
#               why two calls); AIPERF_CONCURRENCY sets the levels, AIPERF_ARGS adds flags
#
# BASELINE=<commit> runs every suite a second time on that commit, checked out with `git worktree
# add` (else `git archive`) outside the repo, and writes its files under $OUT/baseline/. The device
# tool sends the working tree without .git: there, check the commit out beforehand into the ignored
# folder .baseline (`git worktree add --detach .baseline <commit>`, ~15 MiB) and carry it (carry
# [".whl", ".baseline"]); a .baseline folder is used as the baseline tree whenever it exists. ROUNDS=N
# (default 1) repeats each suite N times, the working tree and the baseline interleaved, so that
# before and after come from one call on one machine. The suites' commands are this script's, run
# in the baseline's tree with its code first on the import path: the baseline must have the scripts
# and flags a suite uses.
#
# Add a suite as one more suite_NAME function below and its name in SUITES: one script, not one per
# issue. Each suite runs under `timeout`: TIMEOUT_<suite> seconds, else SUITE_TIMEOUT, else 300. A
# suite's files are appended to, round after round, so give each call a fresh OUT (the device
# machine empties it per command; without OUT the script makes a new folder).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Which code a call ran: the device tool copies the working tree without .git, and the .git found on
# the lent machine can be an older one, so its commit line is no proof. The fingerprint hashes the
# code itself; `bash benchmarks/gpu.sh fingerprint` in a checkout prints the same hash for that tree.
fingerprint() {
  find engine kernels model service training protos benchmarks clients/pie_client -type f \
    \( -name '*.py' -o -name '*.proto' -o -name '*.sh' \) | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
}
[ "${1:-}" = fingerprint ] && { fingerprint; exit 0; }
if [ -d .whl ] || [ -d .site ]; then
  # .site alone: a later call on the same warm machine, whose first call installed the wheels, can
  # leave .whl out of its carry and take a bigger part of the real checkpoint instead
  source benchmarks/gpu_env.sh
else  # the kernel suites need no wheels when the machine has the service's packages
  OUT=${OUT:-$(mktemp -d /tmp/pie-gpu.XXXX)}; mkdir -p "$OUT"
  export PYTHONPATH=$PWD:$PWD/clients HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
fi
# The machines' rule: no NVLink multicast (a program that uses it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T=${SUITE_TIMEOUT:-300}
t() { local v="TIMEOUT_${1//-/_}"; echo "${!v:-$T}"; }
D=$OUT  # where the suite being run writes: $OUT, or $OUT/baseline for the baseline's runs
quiet() {
  grep -v '"event"\|engine_ready\|Writing model shards\|kv_smoothing\|warmed_up\|cuda_graphs_captured\|kv_cache_sized\|Warning\|_warn_once\|warn(\|Loading weights\|_attn_implementation'
}

suite_tests() {
  # the GPU-marked kernel tests, then the unmarked ones that exercise the int8 modes, split_tokens
  # chunk invariance and the decode options (on a GPU they run with bf16 queries and the PTX conversions)
  timeout "$(t tests)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tail -15 | tee -a "$D/tests.log"
  timeout "$(t tests)" python3 -m pytest -q -p no:cacheprovider tests/kernels -k "int8_modes or split_tokens or chunks_give or min_split or sub_tiles" 2>&1 \
    | tail -15 | tee -a "$D/tests.log"
}
suite_alltests() {
  # The modules left out hold no GPU test and import, to be collected, packages the GPU machine
  # lacks (openai, kubernetes_validate).
  # -rfs: the summary names every failure (the tail alone showed only the last one's traceback);
  # the whole output stays in alltests-full.log.
  # (~4-7 minutes on an H100 with Triton's compiles: a call of its own; 260 s stopped it at ~70%)
  # The time limit interrupts it as Ctrl-C would (SIGINT), so that pytest still prints its summary
  # and the slowest tests (-k: killed 20 s later if it does not stop).
  timeout -s INT -k 20 "${TIMEOUT_alltests:-${SUITE_TIMEOUT:-570}}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
    --durations=40 tests --ignore=tests/deploy --ignore=tests/service/http --ignore=tests/service/test_one_path.py 2>&1 \
    | tee "$D/alltests-full.log" | tail -90 | tee -a "$D/alltests.log"
}
suite_kernels() {
  # shellcheck disable=SC2086
  timeout "$(t kernels)" python3 -m benchmarks.attention --graphs --out "$D/kernels.json" ${KERNELS_ARGS:-} 2>&1 | tee -a "$D/kernels.md"
}
suite_variants() {
  # shellcheck disable=SC2086
  timeout "$(t variants)" python3 -m benchmarks.decode_variants --out "$D" ${VARIANTS_ARGS:-} 2>&1 | grep -v "^check" | tail -120
  grep -c "FAIL" "$D/variants.md" | sed 's/^/variants failing their check: /'
}
suite_ncu() {
  timeout "$(t ncu)" python3 -m benchmarks.ncu_decode --profile --out "$D" ${NCU_CASES:+--cases "$NCU_CASES"} 2>&1 | tee -a "$D/ncu.log"
}
suite_roofline() {
  # writes roofline.md and roofline.json (roofline_ncu.* with --ncu) into $D, rewritten row by row
  # shellcheck disable=SC2086
  timeout "${TIMEOUT_roofline:-${SUITE_TIMEOUT:-570}}" python3 -m benchmarks.int8_roofline --out "$D" \
    ${ROOFLINE_ARGS:---stream --buildup} 2>&1 | grep -v "^check .* ok$"
}
suite_extend() { timeout "$(t extend)" python3 -m benchmarks.extend_check --out "$D" 2>&1 | tee -a "$D/extend.log" | tail -30; }
suite_engine() {
  timeout "$(t engine)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine tests/model 2>&1 | tail -12 | tee -a "$D/engine.log"
  suite_profile
}
suite_profile() {
  # profile.md keeps the whole table, kernels included; the call shows its headline lines
  # shellcheck disable=SC2086
  timeout "$(t profile)" python3 -m benchmarks.profile_step --steps 30 ${PROFILE_ARGS:-} 2>&1 | quiet \
    | tee -a "$D/profile.md" | grep -i "wall per\|forward\|median\|busy\|^host:\|pinned"
}
suite_host() {
  timeout "$(t host)" python3 -m benchmarks.profile_step --micro --stub-forward --batch 256 --ctx 400 --steps 50 \
    --extra enforce_eager=true,async_scheduling=true 2>&1 | quiet | tee -a "$D/host.md" | grep "wall per\|Error"
}
suite_offline() {
  # shellcheck disable=SC2086
  timeout "$(t offline)" python3 -m benchmarks.throughput --skip-hf --out "$D/offline.json" ${OFFLINE_ARGS:-} 2>&1 | quiet \
    | tail -9 | tee -a "$D/offline.md"
}
suite_hf() {
  timeout "$(t hf)" python3 -m benchmarks.throughput --out "$D/hf.json" 2>&1 | quiet | tail -9 | tee -a "$D/hf.md"
}
suite_capacity() {
  # 3 GiB of KV: ~166 int8 / ~85 bf16 sequences of 562 tokens, so bf16 preempts
  timeout "$(t capacity)" python3 -m benchmarks.throughput --skip-hf --kv-gib 3 --repeats 1 2>&1 | quiet | grep -v preempted \
    | tail -5 | tee -a "$D/capacity.md"
}
suite_serving() {
  python3 -c 'from pathlib import Path; import torch
from benchmarks.throughput import LLAMA_1B, build_model; Path("/tmp/llama1b").mkdir(exist_ok=True); build_model(Path("/tmp/llama1b"), LLAMA_1B, torch.bfloat16, made_by="pie")' 2>&1 | quiet
  # the engine in its own process (with 1 and 4 tokens per message), then on a thread
  local modes=("--engine-process" "--engine-process --stream-interval 4" "--no-engine-process")
  [ -n "${SERVING_MODE:-}" ] && modes=("$SERVING_MODE")
  for mode in "${modes[@]}"; do
    echo "## pie serve $mode" | tee -a "$D/serving.md"
    timeout "$(t serving)" python3 -m benchmarks.serving --model /tmp/llama1b \
      --server-args="--max-num-seqs 256 --max-num-batched-tokens 8192 $mode" --concurrency "${SERVING_CONCURRENCY:-64,256}" \
      --requests 512 --prompt-len 300 --max-tokens 256 --vocab 32000 2>&1 | quiet | tail -8 | tee -a "$D/serving.md"
  done
  echo "## offline engine, the same requests" | tee -a "$D/serving.md"
  timeout "$(t serving)" python3 -m benchmarks.throughput --skip-hf --kv int8 --requests 512 --min-prompt 300 --max-prompt 300 \
    2>&1 | quiet | tail -3 | tee -a "$D/serving.md"
}
suite_mixed() {
  # shellcheck disable=SC2086
  timeout "$(t mixed)" python3 -m benchmarks.mixed ${MIXED_ARGS:---repeats 3 --single --hf 128 --serve 64,256} \
    --out "$D/mixed.json" 2>&1 | quiet | tee -a "$D/mixed.md" | tail -16
}
suite_long() {
  # shellcheck disable=SC2086
  timeout "$(t long)" python3 -m benchmarks.mixed --workload long --out "$D/long.json" ${LONG_ARGS:-} 2>&1 | quiet | tee -a "$D/long.md"
}
suite_chat() {
  # shellcheck disable=SC2086
  timeout "$(t chat)" python3 -m benchmarks.mixed --workload chat --out "$D/chat.json" ${CHAT_ARGS:-} 2>&1 | quiet | tee -a "$D/chat.md"
}
# The table scripts below keep their whole output in SUITE.log and show the table and any error's
# last line (a table that stopped after its header once hid the traceback that stopped it).
suite_fidelity() {
  timeout "$(t fidelity)" python3 -m benchmarks.kv_fidelity --device cuda --seeds 1 --exact-prefill 2>&1 | quiet \
    | tee -a "$D/fidelity.log" | grep "^|\|Error" | tee -a "$D/fidelity.md"
}
suite_smolpart() {
  mkdir -p "$ROOT/.smol_keep" && cp "$ROOT"/.smol/part-* "$ROOT/.smol_keep/" && ls -l "$ROOT/.smol_keep" | tee -a "$D/smolpart.log"
}
suite_realfidelity() {
  timeout "$(t realfidelity)" python3 -m tests.smollm2 --gguf "$ROOT/.smol_keep" --check 2>&1 | quiet \
    | tee -a "$D/realfidelity.log" | tail -3
  timeout "$(t realfidelity)" python3 -m benchmarks.kv_fidelity --real --device cuda 2>&1 | quiet \
    | tee -a "$D/realfidelity.log" | grep "^|\|Error" | tee -a "$D/realfidelity.md"
}
suite_structured() {
  timeout "$(t structured)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_bitmask.py \
    tests/engine/sample/test_structured.py 2>&1 | tail -8 | tee -a "$D/structured.log"
  timeout "$(t structured)" python3 -m benchmarks.structured --out "$D/structured.json" 2>&1 | quiet \
    | tee -a "$D/structured.md"
}
suite_seeds() {
  # shellcheck disable=SC2086
  timeout "$(t seeds)" python3 -m benchmarks.seed_consistency ${SEEDS_ARGS:-} 2>&1 | quiet \
    | tee -a "$D/seeds.log" | grep "^|\|^#\|Error" | tee -a "$D/seeds.md"
}
suite_tp() {
  local gpus
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  nvidia-smi topo -m 2>&1 | tee -a "$D/tp.log"
  timeout "$(t tp)" python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine/runner/test_tensor_parallel.py \
    tests/engine/runner/test_cuda_graphs.py tests/model/test_parallel.py 2>&1 | tail -30 | tee -a "$D/tp.log"
  local sizes=(1)
  [ "$gpus" -ge 2 ] && sizes=(1 2)
  for shape in llama-1b 4b; do
    for n in "${sizes[@]}"; do
      echo "## throughput $shape N=$n" | tee -a "$D/tp.md"
      timeout "$(t tp)" python3 -m benchmarks.throughput --skip-hf --kv int8 --repeats 3 --shape "$shape" \
        --tensor-parallel-size "$n" 2>&1 | quiet | tail -6 | tee -a "$D/tp.md"
    done
  done
}
suite_lora() {
  # shellcheck disable=SC2086
  timeout "$(t lora)" python3 -m benchmarks.lora_kernels ${LORA_ARGS:-} 2>&1 | quiet | tee -a "$D/lora.md"
}
suite_gemv() {
  # shellcheck disable=SC2086
  timeout "$(t gemv)" python3 -m benchmarks.gemv --budget-s "$(( $(t gemv) - 40 ))" --out "$D/gemv.json" ${GEMV_ARGS:-} 2>&1 \
    | quiet | tee -a "$D/gemv.md"
}
suite_spec() {
  # shellcheck disable=SC2086
  timeout "$(t spec)" python3 -m benchmarks.speculative --only cost,speed --budget-s "${SPEC_BUDGET_S:-200}" \
    --out "$D/spec.json" ${SPEC_ARGS:-} 2>&1 | quiet | tee -a "$D/spec.md"
}
suite_ab() {
  local base
  for base in ${AB_BASES:-$(cd "$ROOT/.ab" 2>/dev/null && ls -d -- */ | tr -d /)}; do  # its folders, not a JSON
    echo "## this tree against ${base/#-/its defaults}" | tee -a "$D/ab.md"
    local against=(--base "$ROOT/.ab/$base")
    [ "$base" = "-" ] && against=()
    # shellcheck disable=SC2086
    timeout "$(t ab)" python3 -m benchmarks.ab "${against[@]}" ${AB_ARGS:---mode quick --rounds 3} \
      --model-cache /tmp/pie-ab-models --out "$D/ab-${base/#-/variant}.json" 2>&1 | quiet | tee -a "$D/ab.md"
  done
}
suite_aiperf() {
  # aiperf runs on the image's numpy, pandas, transformers, aiohttp, ... and the carried rest, in a
  # folder of its own so that nothing of it shadows what pie imports
  if [ -d "$ROOT/.whl-aiperf" ] && [ ! -x "$ROOT/.site-aiperf/run-aiperf" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$ROOT/.site-aiperf" \
      "$ROOT"/.whl-aiperf/*.whl || return 1
    printf '#!/bin/sh\nPYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec python3 -c "import sys; from aiperf.cli import app; sys.exit(app())" "$@"\n' \
      "$ROOT/.site-aiperf" > "$ROOT/.site-aiperf/run-aiperf" && chmod +x "$ROOT/.site-aiperf/run-aiperf"
  fi
  [ -x "$ROOT/.site-aiperf/run-aiperf" ] || { echo "no aiperf: carry .whl-aiperf (bash benchmarks/gpu_prep.sh --aiperf)"; return 1; }
  python3 -c 'from pathlib import Path; import torch
from benchmarks.throughput import LLAMA_1B, build_model
Path("/tmp/llama1b-aiperf").mkdir(exist_ok=True)
build_model(Path("/tmp/llama1b-aiperf"), {**LLAMA_1B, "vocab_size": 2560}, torch.bfloat16, made_by="pie")' 2>&1 | quiet
  # shellcheck disable=SC2086
  timeout "$(t aiperf)" python3 -m benchmarks.aiperf_http --model /tmp/llama1b-aiperf --aiperf "$ROOT/.site-aiperf/run-aiperf" \
    --server-args="--max-num-seqs 256 --max-num-batched-tokens 8192 --kv-cache-dtype int8" \
    --concurrency "${AIPERF_CONCURRENCY:-16,64,256}" --isl 300 --osl 256 --out /tmp/pie-aiperf ${AIPERF_ARGS:-} 2>&1 | quiet \
    | tee -a "$D/aiperf.log" | grep "^|\|Error" | tee -a "$D/aiperf.md"
  # a call brings back 8 files: the levels' figures, not aiperf's ~10 files per level
  cp /tmp/pie-aiperf/levels.json "$D/aiperf.json" 2>/dev/null
}

SUITES=" tests alltests kernels variants ncu roofline extend engine profile host offline hf capacity serving mixed long chat fidelity smolpart realfidelity seeds structured tp spec lora gemv ab aiperf "

g() { git -c safe.directory="$ROOT" -C "$ROOT" "$@"; }  # files copied to a machine may belong to another user
baseline_tree() {  # check BASELINE out outside the repo (or take a carried .baseline); prints its folder
  local sha dir
  if [ -d "$ROOT/.baseline/engine" ]; then echo "$ROOT/.baseline"; return 0; fi
  sha=$(g rev-parse --verify --quiet "$BASELINE^{commit}") \
    || { echo "BASELINE=$BASELINE: no such commit in $ROOT (git needs the repository's .git here)" >&2; return 1; }
  dir=/tmp/pie-baseline-${sha:0:12}
  if [ ! -e "$dir" ]; then
    g worktree add --detach --quiet "$dir" "$sha" >&2 \
      || { mkdir -p "$dir" && g archive "$sha" | tar -x -C "$dir"; } \
      || { echo "BASELINE=$BASELINE: neither git worktree nor git archive could check it out" >&2; return 1; }
  fi
  echo "$dir"
}
run_suite() {  # run_suite SUITE TREE LABEL: the suite in TREE, that tree's code first on the import path
  local tree=$2
  echo "=== $1$3 ($(date -u +%H:%M:%S))"
  [ "$tree" != "$ROOT" ] && echo "    in $tree, PYTHONPATH=${SITE:+$SITE:}$tree:$tree/clients, files in $D"
  (
    cd "$tree" || exit 1
    export PYTHONPATH=${SITE:+$SITE:}$tree:$tree/clients
    "suite_$1"
  )
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
echo "code $(fingerprint) (gpu.sh fingerprint); the .git here says $(g log -1 --format='%h %s' 2>/dev/null | cut -c1-70)"
[ $# -eq 0 ] && { grep '^#   [a-z]' "$0"; exit 2; }
for suite in "$@"; do
  [[ $SUITES == *" $suite "* ]] || { echo "unknown suite: $suite (one of:$SUITES)"; exit 2; }
done
SITE=""
[ -d "$ROOT/.site" ] && SITE=$ROOT/.site
BASE=""
if [ -n "${BASELINE:-}" ]; then
  BASE=$(baseline_tree) || exit 2
  mkdir -p "$OUT/baseline"
  echo "baseline: $(g log -1 --format='%h %s' "$BASELINE" | cut -c1-90) in $BASE"
  [ "$BASE" != "$ROOT/.baseline" ] && trap 'g worktree remove --force "$BASE" 2>/dev/null || rm -rf "$BASE"' EXIT
fi
for suite in "$@"; do
  for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
    r=""
    [ "${ROUNDS:-1}" -gt 1 ] && r=" round $round"
    D=$OUT run_suite "$suite" "$ROOT" "$r"
    [ -n "$BASE" ] && D=$OUT/baseline run_suite "$suite" "$BASE" " (baseline ${BASELINE})$r"
  done
done
# Triton's compiled kernels for the next session (gpu_env.sh says how they come back); only the
# files Triton loads (a kernel's binary and metadata), and only under the 16 MiB a file may bring back
if [ -n "${TRITON_CACHE_DIR:-}" ] && [ -d "$TRITON_CACHE_DIR" ]; then
  (cd "$TRITON_CACHE_DIR" && find . -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) -print0 \
    | tar -czf "$OUT/triton-cache.tgz" --null -T - 2>/dev/null)
  size=$(stat -c %s "$OUT/triton-cache.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt $((15 * 1024 * 1024)) ] || [ "$size" -lt 1024 ]; then rm -f "$OUT/triton-cache.tgz"; fi
  [ -f "$OUT/triton-cache.tgz" ] && echo "triton cache: $((size / 1024)) KiB in triton-cache.tgz (save as .triton-cache.tgz, carry it)"
fi
