#!/usr/bin/env bash
# aiperf (NVIDIA's serving benchmark, PyPI `aiperf`) in a venv of its own, since its pins (pandas,
# rich, pydantic-settings, ...) clash with the project's: `.ci/run` makes it before the tests, whose
# tests/service/http/test_aiperf.py load-tests the HTTP door with it, and benchmarks/aiperf_http.py
# runs it. uv installs the ~140 pinned packages of benchmarks/aiperf-lock.txt in ~6 s (pip: ~90 s).
#
#     bash benchmarks/aiperf_venv.sh [DIR]     # default .venv-aiperf, beside the project's .venv
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.venv-aiperf}
if [ -x "$dest/bin/aiperf" ] && "$dest/bin/aiperf" --version 2>/dev/null | grep -qx "0.13.0"; then
  exit 0
fi
python3 -m venv "$dest"
"$dest/bin/python" -m pip install -q uv==0.13.9
"$dest/bin/python" -m uv pip install -q --python "$dest/bin/python" -r benchmarks/aiperf-lock.txt
"$dest/bin/aiperf" --version >/dev/null
