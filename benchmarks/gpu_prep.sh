#!/usr/bin/env bash
# What the GPU calls carry, made here in one go on a fresh checkout (benchmarks/README.md, "GPU runs",
# "The A/B gate", "The real checkpoint on the GPU"; every folder is git-ignored):
#
#     bash benchmarks/gpu_prep.sh [--smol] [--aiperf] [--part-mb N] [BASE_COMMIT ...]
#
#   .whl/         the wheels the GPU machine lacks (../shared/tools/gpu-wheels.sh, llguidance 1.9.1 in
#                 place of the 1.6.1 it finds, the HTTP door's FastAPI stack, and gguf, accelerate
#                 and psutil for SmolLM2)
#   .ab/<commit>  each BASE_COMMIT's tree for the A/B gate (git archive, without the bundled model
#                 and the tests)
#   .smol/part-N  with --smol: SmolLM2-135M-Instruct's GGUF in parts a call can carry
#                 (tests/smollm2.py --split, --part-mb per part; default 25)
#   .whl-aiperf/  with --aiperf: the wheels of aiperf and of its dependencies the GPU image lacks, at
#                 benchmarks/aiperf-lock.txt's versions (~31 MB; not its plotting packages, which
#                 `aiperf profile` does not import), for `bash benchmarks/gpu.sh aiperf`
#
# Then carry [".whl", ".ab"] for `bash benchmarks/gpu.sh ab`, and see benchmarks/README.md for the
# parts. It prints each folder's size at the end: a call carries 64 MiB at most, the working tree
# (~17 MB with the bundled model's 14 MB) included.
set -euo pipefail
cd "$(dirname "$0")/.."
smol=""
aiperf=""
part_mb=25
bases=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smol) smol=1 ;;
    --aiperf) aiperf=1 ;;
    --part-mb) part_mb=$2; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "unknown flag $1" >&2; exit 2 ;;
    *) bases+=("$1") ;;
  esac
  shift
done
wheel() {  # wheel PACKAGE...: Python 3.12 x86_64 wheels into .whl, without their dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 \
    --platform any -d .whl "$@"
}
[ -d ../shared/tools ] || { echo "../shared/tools/gpu-wheels.sh not found (run from a checkout beside shared/)" >&2; exit 2; }
# A fresh .whl each time: a wheel left from an earlier run beside a newer one of the same package
# (annotated-types 0.7.0 and 0.8.0) stops the GPU machine's pip at once (ResolutionImpossible).
rm -rf .whl
../shared/tools/gpu-wheels.sh >/dev/null
if compgen -G ".whl/llguidance-1.6*" >/dev/null; then
  rm -f .whl/llguidance-1.6*
  wheel llguidance==1.9.1
fi
# The HTTP door's stack and SmolLM2's loaders, at the versions this checkout's environment holds
# where it holds them.
held() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null; }
extra=()
for pkg in fastapi starlette uvicorn h11 click anyio sniffio pydantic pydantic_core annotated-types annotated-doc \
  typing-inspection typing_extensions opentelemetry-api importlib_metadata zipp fastapi-offline gguf accelerate psutil; do
  v=$(held "$pkg" || true)
  extra+=("$pkg${v:+==$v}")
done
wheel "${extra[@]}"
for c in "${bases[@]}"; do
  sha=$(git rev-parse --verify --quiet "$c^{commit}") || { echo "no such commit: $c" >&2; exit 2; }
  rm -rf ".ab/$c" && mkdir -p ".ab/$c"
  git archive "$sha" -- . ':!model/bundled' ':!tests' | tar -x -C ".ab/$c"
done
if [ -n "$smol" ]; then
  PYTHONPATH=$PWD:$PWD/clients${PYTHONPATH:+:$PYTHONPATH} python3 -m tests.smollm2 --split .smol --part-mb "$part_mb"
fi
if [ -n "$aiperf" ]; then
  # aiperf's packages that the GPU image (its package list: the device tool's KINDS.md) does not hold
  carried="aiosqlite aiperf alembic annotated-types blinker brotli cffi colorlog crick cyclopts datasets dill
    docstring-parser fastapi ffmpeg-python flask future httptools importlib-metadata iso8601 itsdangerous jmespath
    jsonpatch jsonpointer kopf kubernetes-asyncio lazy-importer linkify-it-py mako mdit-py-plugins msgspec
    multiprocess nest-asyncio opentelemetry-api optuna orjson platformdirs pycparser pydantic pydantic-core
    pydantic-settings python-dotenv python-json-logger python-multipart pytz pyzmq retrying rich-rst ruamel.yaml
    ruamel.yaml.clib setproctitle soundfile sqlalchemy starlette starlette-compress textual typing-inspection
    tzdata uvicorn watchfiles websockets zstandard"
  pins=()
  for pkg in $carried; do
    pin=$(grep -i "^$pkg==" benchmarks/aiperf-lock.txt) || { echo "$pkg is not in benchmarks/aiperf-lock.txt" >&2; exit 2; }
    pins+=("$pin")
  done
  rm -rf .whl-aiperf
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d .whl-aiperf "${pins[@]}"
fi
du -sh .whl .whl-aiperf .ab/* .smol/* 2>/dev/null || true
