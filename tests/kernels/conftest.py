"""The kernel tests' random inputs: every tensor is drawn from `gen`, a torch generator seeded from
the test's `rng` (tests/conftest.py), so a failure's report names the seed that replays it
(`pytest --seed N`). Tensors are drawn on the CPU and then moved: a CPU generator cannot draw on
the GPU, and the same seed then gives the same inputs on either machine."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture
def gen(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(2**63))
