"""benchmarks/common.py's host facts: where a step's host side ran, and the pin to the GPU's node."""

from __future__ import annotations

import os
import re

import pytest

from benchmarks import common


def test_cpu_lists_read_as_sysfs_writes_them() -> None:
    assert common._cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert common._cpu_list("5") == {5}
    assert common._cpu_list("\n") == set()


def test_host_facts_name_the_cpu_the_allowed_ones_and_the_load() -> None:
    line = common.host_facts()
    match = re.fullmatch(r"host: cpu (\d+) at (\d+ MHz|clock unknown)(, (on|off) the GPU's NUMA node)?; "
                         r"(\d+) of (\d+) CPUs allowed; load [\d.]+, [\d.]+, [\d.]+", line)
    assert match, line
    assert int(match[1]) in os.sched_getaffinity(0) and int(match[5]) == len(os.sched_getaffinity(0))


def test_pin_keeps_to_the_gpu_node_and_what_was_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = os.sched_getaffinity(0)
    monkeypatch.setattr(common, "gpu_local_cpus", lambda: None)
    assert common.pin_to_gpu_node().startswith("not pinned")
    assert os.sched_getaffinity(0) == allowed
    one = min(allowed)
    monkeypatch.setattr(common, "gpu_local_cpus", lambda: {one, max(allowed) + 1000})  # one CPU not allowed here
    try:
        assert common.pin_to_gpu_node() == "pinned to the GPU's 1 NUMA-local CPUs"
        assert os.sched_getaffinity(0) == {one}
    finally:
        os.sched_setaffinity(0, allowed)
