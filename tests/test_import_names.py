"""pie's import names cannot collide (README "Import names"). transformers 5.25+ requires Hugging
Face's `kernels` package, whose import name is also the name of pie's kernels/ folder: when pie
installed its folders as top-level packages, transformers imported pie's folder and failed.

Now the wheel installs `pie` and `pie_client` alone, and the folders are namespace packages that
never hide an installed package, even from the checkout's root, where Python puts them first on
its path. The test extra brings Hugging Face's `kernels`, so these tests always run beside it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
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


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel pip builds from a copy of the tracked files (nothing written into the checkout)."""
    src = tmp_path / "src"
    copy_tracked_files(src)
    try:  # the build backend of this environment when it has one, else pip's isolated build
        isolation = ["--no-build-isolation"] if int(importlib.metadata.version("setuptools").split(".")[0]) >= 68 else []
    except importlib.metadata.PackageNotFoundError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(tmp_path / "dist"),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("pie-*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_installs_pie_and_pie_client_alone(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"pie", "pie_client"}
    for folder in ("engine", "kernels", "model", "service", "training"):  # every source of each folder, under pie/
        sources = {f"pie/{p.relative_to(ROOT)}" for p in (ROOT / folder).rglob("*.py")}
        assert sources and sources <= set(names), sorted(sources - set(names))
    assert "pie/model/bundled/stories-7m/model.safetensors" in names and "pie/v1/generate_pb2.py" in names
    assert not [n for n in names if "__pycache__" in n]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "pie = pie.service.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # installed on its own (no checkout on the path), it imports and finds its bundled model
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import pie.service.cli, pie.engine.core.engine_core, pie.training.cli, pie.kernels.triton_decode, pie_client; "
            "from pathlib import Path; from pie.engine.config import DEFAULT_MODEL; "
            "mods = [pie.service.cli, pie.engine.core.engine_core, pie.training.cli, pie.kernels.triton_decode, pie_client]; "
            f"assert all(Path(m.__file__).is_relative_to({str(target)!r}) for m in mods), mods; "
            "assert (Path(DEFAULT_MODEL) / 'model.safetensors').is_file(), DEFAULT_MODEL")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
