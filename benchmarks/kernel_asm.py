"""Compile the paged decode kernel for the H200 (sm_90) on a machine without a GPU, and report what
the GPU would run: registers, spilled stack, shared memory, and the SASS of the main loop.

    python -m benchmarks.kernel_asm [--head-dim 128] [--kv int8] [--variants default,old,...] [--split-tokens 1024]
    python -m benchmarks.kernel_asm --digest    # one digest of the PTX per shipped attention launch

Uses Triton's own compiler and the ptxas / cuobjdump its wheel ships, with a stand-in driver that
only names the target, so no CUDA device or driver is needed (`TRITON_INTERPRET` must be unset).
Match the GPU machine's Triton version for exact figures (it runs 3.6: `pip install --target DIR
triton==3.6.0`, then PYTHONPATH=DIR). Per variant: `regs`, `stack` (bytes of spilled registers;
0 is what you want), `smem` (bytes per program), and the instructions of the largest loop
(per thread per tile, and warp instructions per key).

`--digest` proves a refactor of the attention kernels on the CPU: it compiles every decode variant
(int8 and bf16 pages, one split and fixed splits) and the extend kernel in every page dtype and int8
mode (with and without the new keys), and prints a digest of each PTX without its line information.
Equal digests before and after a change mean the GPU runs the same instructions.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from benchmarks.common import make_parser

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _Sm90:
    """Stand-in driver: names the target, launches nothing."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def sass_report(cubin: bytes) -> tuple[dict, list[tuple[int, dict]]]:
    """cuobjdump's resource usage and, per backward-branch loop, (instruction count, opcode counts)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    res = subprocess.run([BIN / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    sass = subprocess.run([BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*\S*)\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            counts: dict[str, int] = {}
            for a, o, _ in ins:
                if lo <= a <= addr:
                    counts[o] = counts.get(o, 0) + 1
            loops.append((sum(counts.values()), counts))
    return usage, sorted(loops, key=lambda x: -x[0])


def compile_decode(cfg, d: int, group: int, int8: bool, page: int = 16, hkv: int = 8, split_tokens: int = 0,
                   worklist: bool = False):
    """The stage-1 kernel as paged_decode would launch it for one split (DIRECT), or with fixed
    splits of `split_tokens` keys (the engine's launch), on a work list of splits with `worklist`,
    compiled only: (compiled kernel, the DecodeConfig used)."""
    import pie.kernels.triton_decode as td

    d_pad = max(16, triton.next_power_of_2(d))
    cfg = cfg or td._config(d_pad, page, torch.int8 if int8 else torch.bfloat16, True)
    b, nb = 4, 64
    q = torch.empty(b, hkv * group, d, dtype=torch.bfloat16)
    k = torch.empty(nb, page, hkv, d, dtype=torch.int8 if int8 else torch.bfloat16)
    ks = torch.empty(nb, hkv, page, dtype=torch.float16) if int8 else k
    table = torch.empty(b, 16, dtype=torch.int32)
    lens = torch.empty(b, dtype=torch.int32)
    block_m = triton.next_power_of_2(group) if cfg.tight_m else max(16, triton.next_power_of_2(group))
    half = tl.float16
    kernel = td._decode_stage1.warmup(
        q, k, k, ks, ks, table, lens, q, q, q, lens, 0.1, q.stride(0), q.stride(1), table.stride(0), q.stride(0),
        q.stride(1), 1, b,
        G=group, HQ=hkv * group, HKV=hkv, K_T=cfg.k_t, SPLIT_TOKENS=split_tokens, DIRECT=not split_tokens, WINDOW=0,
        PAGE=page, D=d,
        D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=cfg.block_n, IS_INT8=int8, K_MODE=td.K_MODES[cfg.k_mode],
        V_MODE=td.V_MODES[cfg.v_mode], DOT_DTYPE=tl.bfloat16,
        QK_DTYPE=half if int8 and cfg.k_mode == "bias" else tl.bfloat16,
        PV_DTYPE=half if int8 and cfg.v_mode != "cast" else tl.bfloat16, PRECISION=None, ASM=True, WORKLIST=worklist,
        W=cfg.sub_tiles, MIN_TILES=1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,),
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}))
    return kernel, cfg


def compile_extend(quant: bool, new_kv: bool, k_mode: str = "cast", v_mode: str = "cast", d: int = 128,
                   group: int = 4, page: int = 16, hkv: int = 8):
    """The extend kernel as paged_extend launches it on the GPU (its default tiles), compiled only."""
    import pie.kernels.triton_decode as td
    import pie.kernels.triton_extend as te

    d_pad = te.pad_head_dim(d)
    block_m, block_n, warps, stages = te._default_config(d_pad, quant, new_kv, interpret=False)
    g_pad = triton.next_power_of_2(group)
    q = torch.empty(64, hkv * group, d, dtype=torch.bfloat16)
    kn = torch.empty(64, hkv, d, dtype=torch.bfloat16)
    cache = torch.empty(64, page, hkv, d, dtype=torch.int8 if quant else torch.bfloat16)
    scale = torch.empty(64, hkv, page, dtype=torch.float16) if quant else cache
    table = torch.empty(4, 16, dtype=torch.int32)
    lens = torch.empty(5, dtype=torch.int32)
    half = tl.float16
    return te._extend_kernel.warmup(
        q, kn, kn, cache, cache, scale, scale, table, lens, lens, q, 0.1, 4, 20,
        q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), kn.stride(0), kn.stride(1), q.stride(0), q.stride(1),
        table.stride(0), cache.stride(0), cache.stride(1),
        HKV=hkv, G=group, G_PAD=g_pad, D=d, D_PAD=d_pad, BLOCK_SIZE=page, BLOCK_Q=block_m // g_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, QUANT=quant, NEW_KV=new_kv, WINDOW=0, DOT_DTYPE=tl.bfloat16,
        PRECISION=None, K_MODE=td.K_MODES[k_mode] if quant else 0,
        V_MODE=2 if quant and v_mode == "bias" else 0, QK_DTYPE=half, PV_DTYPE=half, ASM=True,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False, grid=(1,))


_DEBUG_LABEL = re.compile(r"\$L__(tmp|func_begin|func_end)\d+:")


def ptx_digest(kernel) -> str:
    """sha256 of the kernel's PTX without its line information (.loc and .file lines, the labels
    the line table points at, the debug sections), which moves with edits that change no instruction."""
    ptx = kernel.asm["ptx"].split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    lines = [line for line in ptx.splitlines()
             if line.strip() and not line.lstrip().startswith((".loc", ".file", "//"))
             and not _DEBUG_LABEL.fullmatch(line.strip())]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def digests(head_dims: tuple[int, ...] = (64, 128)) -> list[tuple[str, str]]:
    """(launch, PTX digest) of every shipped attention launch at `head_dims`."""
    from benchmarks.decode_variants import VARIANTS

    rows = []
    for d in head_dims:
        for name, cfg in VARIANTS.items():
            for split in (0, 1024):
                kernel, _ = compile_decode(cfg, d, 4, True, split_tokens=split)
                rows.append((f"decode int8 {name} d{d} split{split}", ptx_digest(kernel)))
        for split in (0, 1024):
            kernel, _ = compile_decode(None, d, 4, False, split_tokens=split)
            rows.append((f"decode bf16 d{d} split{split}", ptx_digest(kernel)))
        for quant, new_kv, k_mode, v_mode in ((False, False, "cast", "cast"), (False, True, "cast", "cast"),
                                              (True, True, "cast", "cast"), (True, False, "cast", "cast"),
                                              (True, False, "bias", "bias"), (True, False, "imma", "bias"),
                                              (True, False, "imma", "cast")):
            kernel = compile_extend(quant, new_kv, k_mode, v_mode, d=d)
            rows.append((f"extend {'int8' if quant else 'bf16'} new_kv={new_kv} {k_mode}/{v_mode} d{d}",
                         ptx_digest(kernel)))
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.decode_variants import VARIANTS

    ap = make_parser(__doc__)
    ap.add_argument("--head-dim", type=int, default=128, help="head dim of the compiled launch")
    ap.add_argument("--group", type=int, default=4, help="query heads per kv head")
    ap.add_argument("--kv", choices=("int8", "bf16"), default="int8", help="page dtype")
    ap.add_argument("--variants", default="default,old", help="names from benchmarks/decode_variants.py")
    ap.add_argument("--split-tokens", type=int, default=0,
                    help="compile the fixed-split launch of that many keys per split (the engine's: 1024); 0 = one split")
    ap.add_argument("--worklist", action="store_true",
                    help="with --split-tokens: the persistent launch that takes splits from a work list")
    ap.add_argument("--digest", action="store_true",
                    help="print a PTX digest of every shipped attention launch (compare two trees' outputs)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.exit(2, "kernel_asm.py compiles for the GPU: unset TRITON_INTERPRET\n")
    driver.set_active(_Sm90())
    if args.digest:
        print(f"# triton {triton.__version__}, sm_90")
        for name, digest in digests():
            print(f"{digest}  {name}")
        return 0
    print(f"triton {triton.__version__}, sm_90, head dim {args.head_dim}, group {args.group}, {args.kv} pages")
    for name in args.variants.split(","):
        cfg = VARIANTS[name] if args.kv == "int8" else None
        kernel, cfg = compile_decode(cfg, args.head_dim, args.group, args.kv == "int8", split_tokens=args.split_tokens,
                                     worklist=args.worklist)
        usage, loops = sass_report(kernel.asm["cubin"])
        line = (f"{name:14s} regs {usage.get('reg')} stack {usage.get('stack')} smem {kernel.metadata.shared} "
                f"warps {kernel.metadata.num_warps}")
        if loops:
            n, counts = loops[0]
            top = " ".join(f"{op}:{c}" for op, c in sorted(counts.items(), key=lambda x: -x[1])[:8])
            # what ties a tile's warps together or waits on shared memory: barriers, stores, loads, shuffles
            family = {kind: sum(c for op, c in counts.items() if op.startswith(prefix))
                      for kind, prefix in (("bar", "BAR"), ("sts", "STS"), ("lds", "LDS"), ("shfl", "SHFL"))}
            line += (f" | loop {n} instr/thread ({n * kernel.metadata.num_warps / cfg.block_n:.1f} warp-instr/key)"
                     f" | {' '.join(f'{k} {v}' for k, v in family.items())} | {top}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
