"""Test-wide set-up: offline hub, GPU tests skipped without CUDA, the seeded `rng` fixture."""

import gc
import os
import random

# Nothing is downloaded in tests: a hub id must fail at once instead of retrying DNS.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter; it must be on before any kernel is
# defined (i.e. before kernels.triton_* is imported). On a CUDA machine they compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# torch's intra-op threads as the process starts (the machine's cores)
THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """EngineCore freezes the objects alive at its start (gc.freeze); hand them back to the
    collector after each test so that engines of finished tests are freed. An EngineCore built on
    the test's thread also set that thread's torch threads to its own count (one core short of the
    machine, by default): the next test starts with the machine's again."""
    yield
    gc.unfreeze()
    torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="seed of every test's `rng` fixture (to replay a failure; default: fresh per test)")


@pytest.fixture
def rng(request) -> random.Random:
    """Fresh random inputs for each test, reproducible: a failing test's report names its seed,
    and `pytest --seed N <test>` replays it."""
    seed = request.config.getoption("--seed")
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    request.node.user_properties.append(("rng seed", seed))
    return random.Random(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        for name, seed in item.user_properties:
            if name == "rng seed":
                report.sections.append(("rng seed", f"{seed}: replay with pytest --seed {seed} '{item.nodeid}'"))
