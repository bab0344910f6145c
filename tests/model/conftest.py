"""Shared tiny checkpoints for the model tests: each case is built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import make_hf_model_dir
from tests.model.oracle import CASES, WEIGHT_SCALE


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """model_dir(case) -> folder of that CASES entry, built on first use."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            arch, overrides = CASES[case]
            built[case] = make_hf_model_dir(root, arch, weight_scale=WEIGHT_SCALE, **overrides)
        return built[case]

    return get


@pytest.fixture(scope="session")
def hf_model(model_dir: Callable[[str], Path]):
    """hf_model(case) -> the transformers model of that case (fp32, eval), loaded once."""
    import torch
    import transformers

    loaded = {}

    def get(case: str):
        if case not in loaded:
            loaded[case] = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir(case), dtype=torch.float32).eval()
        return loaded[case]

    return get
