"""pie's import names cannot collide (README "Import names"). transformers 5.25+ requires Hugging
Face's `kernels` package, whose import name is also the name of pie's kernels/ folder: when pie
installed its folders as top-level packages, transformers imported pie's folder and failed.

Now the two wheels install `pie.*` and `pie_client` alone, and the folders are namespace packages
that never hide an installed package, even from the checkout's root, where Python puts them first
on its path. The test extra brings Hugging Face's `kernels`, so these tests always run beside it.

Each import name has one owner: the server's wheel installs pie.engine, pie.kernels, pie.model,
pie.service and pie.training, the client's (clients/) pie.v1 and pie_client, and `pie` is a
namespace neither owns. Their files never overlap, so installing one over the other, or
uninstalling one, leaves the other whole."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, copy_tracked_files


def _is_hugging_faces(module_file: str) -> bool:
    """module_file is one of the files the `kernels` distribution (Hugging Face's) installed."""
    dist = importlib.metadata.distribution("kernels")
    installed = {Path(dist.locate_file(f)).resolve() for f in dist.files or []}
    return Path(module_file).resolve() in installed


def test_kernels_in_the_test_process_is_hugging_faces() -> None:
    """`python -m pytest` from the root puts the root (pie's kernels/ folder) first on the path."""
    import kernels

    assert kernels.__file__ is not None and _is_hugging_faces(kernels.__file__), kernels
    assert hasattr(kernels, "get_kernel")  # Hugging Face's API, not a folder of ours


# Run from the checkout's root: `python -c` puts the root first on the path, as a user's shell there does.
ONE_PROCESS = r"""
import os, sys
import importlib.metadata
from pathlib import Path

import kernels
dist = importlib.metadata.distribution("kernels")
assert Path(kernels.__file__).resolve() in {Path(dist.locate_file(f)).resolve() for f in dist.files}, kernels

import torch
import transformers  # builds the model below, which imports Hugging Face's `kernels` in 5.25+

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams
from pie.kernels import reference
from pie.kernels.triton_cache_write import write_kv_cache
from tests.helpers import make_hf_model_dir

model_dir = make_hf_model_dir(Path(sys.argv[1]), "llama", seed=int(sys.argv[2]), weight_scale=2.5)
hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

# pie's engine on the model transformers built: greedy, checked token by token against
# transformers' logits of the whole sequence (a near-tie may go either way)
engine = EngineCore(EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=32))
prompt = [5, 17, 42, 8, 99, 3]
engine.add_request("r0", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
tokens = []
while engine.has_unfinished():
    for out in engine.step():
        tokens.extend(out.new_token_ids)
assert len(tokens) == 8, tokens
with torch.no_grad():
    logits = hf(torch.tensor([prompt + tokens])).logits[0]
for i, token in enumerate(tokens):
    top = logits[len(prompt) - 1 + i].topk(2)
    assert token == int(top.indices[0]) or float(top.values[0] - top.values[1]) < 1e-3, (i, token, top)

# pie's Triton cache write (the interpreter on a CPU) against its torch twin: the same bits
gen = torch.Generator().manual_seed(int(sys.argv[2]))
k, v = (torch.randn(6, 2, 16, generator=gen) for _ in range(2))
slots = torch.tensor([3, 0, -1, 17, 9, 30])
caches = [[torch.zeros(4, 8, 2, 16, dtype=torch.int8) for _ in range(2)] + [torch.zeros(4, 2, 8, dtype=torch.float16)
          for _ in range(2)] for _ in range(2)]
write_kv_cache(k, v, *caches[0], slots)
reference.write_kv_cache(k, v, *caches[1], slots)
assert all(torch.equal(a, b) for a, b in zip(*caches))
print("one process:", Path(kernels.__file__).parent, transformers.__version__, tokens)
"""


@pytest.mark.slow
def test_hugging_faces_kernels_transformers_and_pie_in_one_process(tmp_path: Path, rng) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients'}"}
    run = subprocess.run([sys.executable, "-c", ONE_PROCESS, str(tmp_path), str(rng.randrange(2**31))], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "one process:" in run.stdout


SERVER = ("engine", "kernels", "model", "service", "training")


def _pip(*args: str, timeout: float = 300) -> None:
    """pip of this environment; no PYTHONPATH, whose distributions it would take for installed ones."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-m", "pip", *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """The server's and the client's wheels as pip builds them from a copy of the tracked files
    (nothing written into the checkout)."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    copy_tracked_files(src)
    try:  # the build backend of this environment when it has one, else pip's isolated build
        isolation = ["--no-build-isolation"] if int(importlib.metadata.version("setuptools").split(".")[0]) >= 68 else []
    except importlib.metadata.PackageNotFoundError:
        isolation = []
    _pip("wheel", "-q", "--no-deps", *isolation, "-w", str(tmp / "dist"), str(src), str(src / "clients"))
    (server,) = (tmp / "dist").glob("pie-*.whl")
    (client,) = (tmp / "dist").glob("pie_client-*.whl")
    return {"pie": server, "pie-client": client}


def _files(wheel: Path) -> set[str]:
    return {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}


def _metadata(wheel: Path, name: str) -> str:
    (path,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(f".dist-info/{name}")]
    return zipfile.ZipFile(wheel).read(path).decode()


@pytest.mark.slow
def test_each_import_name_has_one_owner(wheels: dict[str, Path]) -> None:
    server, client = _files(wheels["pie"]), _files(wheels["pie-client"])
    assert not server & client, sorted(server & client)
    assert "pie/__init__.py" not in server | client  # `pie` is a namespace package, no one's
    assert {n.split("/")[0] for n in server} == {"pie"} and {n.split("/")[1] for n in server} == set(SERVER)
    assert {"/".join(n.split("/")[:2]) for n in client} == {"pie/v1"} | {n for n in client if n.startswith("pie_client/")}
    for folder in SERVER:  # every source of each folder, under pie/
        sources = {f"pie/{p.relative_to(ROOT)}" for p in (ROOT / folder).rglob("*.py")}
        assert sources and sources <= server, sorted(sources - server)
    assert "pie/model/bundled/stories-7m/model.safetensors" in server
    assert {"pie/v1/generate_pb2.py", "pie/v1/generate_pb2_grpc.py", "pie_client/cli.py"} <= client
    assert not [n for n in server | client if "__pycache__" in n]
    assert re.findall(r"^(\S+) = ", _metadata(wheels["pie"], "entry_points.txt"), re.M) == ["pie"]
    assert re.findall(r"^(\S+) = ", _metadata(wheels["pie-client"], "entry_points.txt"), re.M) == ["pie-client"]

    # the server requires this client exactly, at a local version, which PyPI refuses on upload: pip
    # never takes PyPI's unrelated `pie-client` for it
    (version,) = re.findall(r"^Version: (.+)$", _metadata(wheels["pie-client"], "METADATA"), re.M)
    assert "+" in version, version
    assert f"Requires-Dist: pie-client=={version}" in _metadata(wheels["pie"], "METADATA").splitlines()


# In a new virtual environment holding only what pip put there (-I: no checkout, no PYTHONPATH):
# the removed distribution's names are gone, every file of the remaining one is there, and its
# modules import from there (third-party dependencies from this environment, appended last).
AFTER_UNINSTALL = r"""
import importlib.metadata, importlib.util, sys
from pathlib import Path
kept, gone, own, outer = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), sys.argv[4:]
assert [n for n in gone if importlib.util.find_spec(n) is not None] == [], gone
dist = importlib.metadata.distribution(kept)
missing = [str(f) for f in dist.files if not Path(dist.locate_file(f)).exists()]
assert not missing, missing
sys.path.extend(outer)
for name in own:
    module = importlib.import_module(name)
    assert Path(module.__file__).is_relative_to(sys.prefix), module
print("kept:", kept, len(dist.files), "files")
"""
# What each distribution's own modules are, checked once the other is gone (the server's service/
# needs the client's stubs, which it requires; engine, kernels, model and training do not).
OWN = {"pie": ["pie.engine.core.engine_core", "pie.kernels.triton_decode", "pie.model.llama", "pie.training.cli"],
       "pie-client": ["pie.v1.generate_pb2_grpc", "pie_client.cli"]}
GONE = {"pie": ["pie.engine", "pie.kernels", "pie.model", "pie.service", "pie.training"],
        "pie-client": ["pie.v1", "pie_client"]}


@pytest.mark.slow
@pytest.mark.parametrize("first", ["pie", "pie-client"])
def test_either_survives_the_other_installed_over_it_and_uninstalled(wheels: dict[str, Path], first: str,
                                                                     tmp_path: Path) -> None:
    second = "pie-client" if first == "pie" else "pie"
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = str(env / "bin" / "python")
    _pip("--python", python, "install", "-q", "--no-deps", str(wheels[first]))
    _pip("--python", python, "install", "-q", "--no-deps", str(wheels[second]))
    _pip("--python", python, "uninstall", "-q", "-y", second)
    run = subprocess.run([python, "-I", "-c", AFTER_UNINSTALL, first, ",".join(GONE[second]), ",".join(OWN[first]),
                          *[p for p in sys.path if Path(p).name == "site-packages"]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"kept: {first}" in run.stdout
