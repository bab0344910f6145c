"""Test-wide set-up: offline hub, GPU tests skipped without CUDA."""

import gc
import os

# Nothing is downloaded in tests: a hub id must fail at once instead of retrying DNS.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter; it must be on before any kernel is
# defined (i.e. before kernels.triton_* is imported). On a CUDA machine they compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """LLMEngine freezes the objects alive at its start (gc.freeze); hand them back to the
    collector after each test so that engines of finished tests are freed."""
    yield
    gc.unfreeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
