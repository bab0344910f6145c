"""INT8 pages against transformers on models whose K has massive channels (as real checkpoints
do), for the four families at head dim 64: K/V smoothing (model/smoothing.py) must hold the int8
cache's fidelity where per-(token, head) scales alone lose it, the first token included (the
prefill reads its own K/V as stored, rounded, like every later step: one answer per seed), and the
KL to fp32 must stay small. Figures are measured on fresh random models each run; the seed is
printed."""

from __future__ import annotations

import random

import pytest

from tests.fidelity import MASSIVE_K, family_fidelity, mean
from tests.helpers import ARCHS

# slow: builds and runs transformers models for ~15 s
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def massive_models(tmp_path_factory):
    seed = random.randrange(2**31)
    print(f"fidelity seed={seed}")
    tmp = tmp_path_factory.mktemp("fidelity")
    smoothed = family_fidelity(tmp, ARCHS, ("int8", "bf16"), prompts=16, tokens=32, seed=seed,
                               weight_scale=2.5, massive_k=MASSIVE_K)
    raw = family_fidelity(tmp, ARCHS, ("int8",), prompts=16, tokens=32, seed=seed, weight_scale=2.5,
                          massive_k=MASSIVE_K, kv_smoothing="off")
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


def test_first_token_and_kl_to_fp32(massive_models):
    """The first token depends only on the prompt's prefill, which reads its own K/V as stored:
    smoothed int8 pages give transformers' first token nearly as bf16 pages do, unsmoothed ones
    lose more to the massive channels. Measured (fresh models per run, 4 families x 16 prompts):
    first token 0.94-1.0 smoothed (bf16 0.94-1.0: a random model's near-ties can take a few first
    tokens under bf16 rounding too, 62 of 64 once and 60 of 64 once, the second in CI on
    2026-12-05), 0.91-0.94 raw; KL to fp32 4e-5 smoothed int8, 9e-4 raw, 3e-6 bf16
    (benchmarks/kv_fidelity.py, RESULTS.md). The first-token bounds leave room for those near-ties;
    the KL ordering below is what separates the caches."""
    smoothed, raw = massive_models
    assert mean(smoothed, "int8", "first_token") >= 0.9, mean(smoothed, "int8", "first_token")
    assert mean(smoothed, "bf16", "first_token") >= 0.9, mean(smoothed, "bf16", "first_token")
    assert mean(smoothed, "int8", "kl") < mean(raw, "int8", "kl"), "smoothing did not bring int8 closer to fp32"
    assert mean(smoothed, "bf16", "kl") < mean(smoothed, "int8", "kl")
