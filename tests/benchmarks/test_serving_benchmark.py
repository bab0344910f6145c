"""CI's smoke run of the serving benchmark by arrival rate (benchmarks/serving.py) on the bundled
model: a Poisson sweep, a burst and a closed-loop level in a few seconds, every figure in its JSON,
the latency plots drawn; and the workloads' length distributions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving import workload

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sweep_burst_and_closed_loop_on_the_bundled_model(tmp_path):
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "-m", "benchmarks.serving", "--workload", "chat", "--prompt-len", "24", "--max-tokens", "12",
           "--requests", "6", "--sweep", "4", "--max-rate", "8", "--burst", "--concurrency", "2",
           "--out", str(out), "--plot", str(tmp_path / "p"), "--server-args=--device cpu"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients'}"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["burst", "closed", "poisson", "poisson"]  # the burst first: a cold server
    assert [r["load"] for r in rows if r["mode"] == "poisson"] == [4.0, 8.0]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 6 and r["tokens"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["tpot_p50_ms"] > 0 and 0 <= r["slo_met"] <= 1
        assert r["goodput_req_per_s"] <= r["req_per_s"] + 1e-9
    assert (tmp_path / "p-poisson-latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in run.stdout and "TPOT" in run.stdout
    # the engine steps each level ran, from the server's metrics (the first after idle is not timed)
    assert all(sum(r["server_steps"][kind]["steps"] for kind in ("decode", "prompt")) > 0 for r in rows)
    assert sum(r["server_steps"]["prompt_tokens"] for r in rows) > 0
    assert all(r["server_steps"]["unbounded"] >= 0 for r in rows)
    assert "server steps:" in run.stdout


@pytest.mark.parametrize("kind", ["fixed", "chat", "mixed", "long"])
def test_workloads_draw_what_they_say(kind):
    work = workload(kind, 300, 1000, prompt_len=100, max_tokens=64, scale=1.0)
    lens = sorted(map(len, work.prompts))
    assert len(work.prompts) == len(work.max_tokens) == 300 and min(work.max_tokens) >= 1
    if kind == "fixed":
        assert set(lens) == {100} and set(work.max_tokens) == {64}
    elif kind == "chat":
        assert 60 <= lens[150] <= 160 and 16 <= min(work.max_tokens) and max(work.max_tokens) <= 64
    else:
        prefix_len, every, median, outs = {"mixed": (400, 4, 250, (32, 400)), "long": (1500, 3, 800, (128, 1024))}[kind]
        shared = [p for i, p in enumerate(work.prompts) if i % every == 0]
        assert all(p[:prefix_len] == shared[0][:prefix_len] for p in shared)  # one shared prefix
        bodies = sorted(len(p) - (prefix_len if i % every == 0 else 0) for i, p in enumerate(work.prompts))
        assert 0.7 * median <= bodies[150] <= 1.3 * median
        assert outs[0] <= min(work.max_tokens) and max(work.max_tokens) <= outs[1]
    scaled = workload(kind, 300, 1000, prompt_len=100, max_tokens=64, scale=0.1)
    if kind in ("mixed", "long"):
        assert max(map(len, scaled.prompts)) < 0.2 * max(lens)
