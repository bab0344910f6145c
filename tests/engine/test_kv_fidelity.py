"""INT8 pages against transformers on models whose K has massive channels (as real checkpoints
do), for the four families at head dim 64: K/V smoothing (model/smoothing.py) must hold the int8
cache's fidelity where per-(token, head) scales alone lose it, and the prompt's own K/V (read as
computed in prefill) must give the first token exactly. Figures are measured on fresh random
models each run; the seed is printed."""

from __future__ import annotations

import random

import pytest

from tests.fidelity import MASSIVE_K, family_fidelity, mean
from tests.helpers import ARCHS


@pytest.fixture(scope="module")
def massive_models(tmp_path_factory):
    seed = random.randrange(2**31)
    print(f"fidelity seed={seed}")
    tmp = tmp_path_factory.mktemp("fidelity")
    smoothed = family_fidelity(tmp, ARCHS, ("int8", "bf16"), prompts=16, tokens=32, seed=seed,
                               weight_scale=2.5, massive_k=MASSIVE_K)
    raw = family_fidelity(tmp, ARCHS, ("int8",), prompts=16, tokens=32, seed=seed, weight_scale=2.5,
                          massive_k=MASSIVE_K, kv_smoothing=False)
    return smoothed, raw


def test_smoothing_survives_massive_k_channels(massive_models):
    smoothed, raw = massive_models
    report = {name: {kv: (round(mean(r, kv, "agreement"), 3), round(mean(r, kv, "teacher_forced"), 4))
                     for kv in next(iter(r.values()))} for name, r in (("smoothed", smoothed), ("raw", raw))}
    print(report)
    # Measured (4 seeds): teacher-forced top-1 0.983 smoothed against 0.917 raw; greedy agreement
    # 0.79 against 0.33 (bf16 pages 0.945 / 0.997).
    assert mean(smoothed, "int8", "teacher_forced") >= 0.97
    assert mean(smoothed, "int8", "agreement") >= 0.6
    assert mean(smoothed, "int8", "teacher_forced") >= mean(raw, "int8", "teacher_forced") + 0.03, \
        "the massive channels did not hurt the unsmoothed cache: the test lost its point"
    assert mean(smoothed, "bf16", "teacher_forced") >= 0.99


def test_first_token_from_an_exact_prefill(massive_models):
    """The first token depends only on the prompt's prefill, which attends to its own K/V as
    computed: int8 pages give transformers' first token as bf16 pages do (a rounding-level near
    tie between fp32 implementations may flip one of the 64 prompts)."""
    smoothed, raw = massive_models
    for kv in ("int8", "bf16"):
        assert mean(smoothed, kv, "first_token") >= 0.98, (kv, mean(smoothed, kv, "first_token"))
    assert mean(raw, "int8", "first_token") >= 0.98  # exact whatever the smoothing
