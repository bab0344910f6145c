# Sourced by benchmarks/gpu.sh on the lent machine, from the repo root with .whl carried
# (../shared/tools/gpu-wheels.sh fills it): installs the wheels the machine lacks into .site, sets
# the import path and the offline switches, and makes $OUT (a fresh folder unless OUT is set).
OUT=${OUT:-$(mktemp -d /tmp/pie-gpu.XXXX)}
mkdir -p "$OUT"
# Only the wheels this interpreter can take (a .whl filled for the GPU's Python 3.12 may sit in a
# checkout that runs the suites on another Python, as tests/benchmarks does).
WHEELS=$(python3 - <<'PY'
import glob
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename
ours = set(sys_tags())
print(" ".join(w for w in sorted(glob.glob(".whl/*.whl"))
               if set(parse_wheel_filename(w.rsplit("/", 1)[-1])[3]) & ours))
PY
) || exit 1
if [ -n "$WHEELS" ]; then
  # shellcheck disable=SC2086  # one word per wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site $WHEELS || exit 1
fi
export PYTHONPATH=$PWD/.site:$PWD:$PWD/clients
# Triton's compiled kernels, kept from one session's machine to the next (compiles are much of
# `pytest -m gpu`'s time): gpu.sh packs them into $OUT/triton-cache.tgz at the end of a call; that
# file, saved as .triton-cache.tgz in the checkout and carried, is unpacked here. Triton's own key
# (source, constants, GPU, versions) decides what is reused, so a stale entry is never run.
export TRITON_CACHE_DIR=$PWD/.triton-cache
if [ -f .triton-cache.tgz ] && [ ! -d .triton-cache ]; then
  mkdir -p .triton-cache && tar -xzf .triton-cache.tgz -C .triton-cache && python3 - <<'PY'
# A kernel's group file names its files by absolute path: the machine's checkout may sit elsewhere.
import json, os, pathlib
root = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
groups = list(root.glob("*/__grp__*.json"))
for g in groups:
    data = json.loads(g.read_text())
    data["child_paths"] = {c: str(g.parent / pathlib.Path(p).name) for c, p in data.get("child_paths", {}).items()}
    g.write_text(json.dumps(data))
print(f"triton cache: {len(groups)} kernels unpacked from .triton-cache.tgz")
PY
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
