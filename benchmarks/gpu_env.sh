# Sourced by benchmarks/gpu.sh on the lent machine, from the repo root with .whl carried
# (../shared/tools/gpu-wheels.sh fills it): installs the wheels the machine lacks into .site, sets
# the import path and the offline switches, and makes $OUT (a fresh folder unless OUT is set).
OUT=${OUT:-$(mktemp -d /tmp/pie-gpu.XXXX)}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  && export PYTHONPATH=$PWD/.site:$PWD:$PWD/clients || exit 1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
