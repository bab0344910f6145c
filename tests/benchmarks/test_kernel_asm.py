"""`python -m benchmarks.kernel_asm --digest`, the CPU's proof that a refactor of a kernel changes no
instruction: a kernel whose source moves (blank lines, comments, a helper pulled out of it) keeps its
digest; one whose arithmetic changes does not. Compiling for sm_90 needs Triton's compiler, not its
interpreter, so the kernels compile in a subprocess without TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

INLINE = """
import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    qa = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30) / 127.0
    q = tl.floor(x / qa + 0.5)
    tl.store(out_ptr + offs, (q * qa).to(tl.float16))
"""

HELPER = """
import triton
import triton.language as tl

# The same arithmetic, moved into a helper further down the file, with comments between.


@triton.jit
def quantize(x):
    # per-tensor scale
    qa = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30) / 127.0

    return tl.floor(x / qa + 0.5), qa


@triton.jit
def kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)

    x = tl.load(x_ptr + offs).to(tl.float32)
    q, qa = quantize(x)  # moved
    tl.store(out_ptr + offs, (q * qa).to(tl.float16))
"""

CHANGED = INLINE.replace("127.0", "126.0")

DRIVER = """
import importlib.util, sys
import torch
from triton.runtime import driver
from benchmarks import kernel_asm

driver.set_active(kernel_asm._Sm90())
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[-1][:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.empty(64, dtype=torch.float16)
    compiled = module.kernel.warmup(x, x, N=64, grid=(1,))
    print(kernel_asm.ptx_digest(compiled))
"""


def test_digest_follows_instructions_not_source(tmp_path):
    paths = []
    for name, source in (("inline", INLINE), ("helper", HELPER), ("changed", CHANGED)):
        path = tmp_path / f"k_{name}.py"
        path.write_text(textwrap.dedent(source))
        paths.append(str(path))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "clients")])
    run = subprocess.run([sys.executable, "-c", DRIVER, *paths], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    inline, helper, changed = run.stdout.split()
    assert inline == helper, "moving arithmetic into a helper changed no instruction, but the digest moved"
    assert changed != inline, "a changed constant must change the digest"


def test_digest_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_asm", "--digest"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unset TRITON_INTERPRET" in run.stderr
