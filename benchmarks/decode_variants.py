"""Scratch GPU script for kernels/triton_decode.py: correctness (bf16 q vs the fp32 reference),
then timings of (BLOCK_N, num_stages, num_splits) variants against SDPA on contiguous bf16 K/V.

    python3 benchmarks/decode_variants.py [--quick] [--out DIR]
    python3 benchmarks/decode_variants.py --engine     # or --d64, --v3, --v2: a later round's sweep

Median of triton.testing.do_bench (it zeroes a 256 MB buffer before every rep: L2 flushed).
Bandwidth counts the K/V bytes (int8 plus fp16 scales, or bf16) once. Writes the table (and, for
the first sweep and --v2, the stage-1 PTX of the gate config) to --out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.triton_decode as td  # noqa: E402
from benchmarks.common import make_parser, require_cuda  # noqa: E402
from kernels.reference import paged_attention_decode  # noqa: E402

NEEDS_GPU = True  # read by `pie bench` (with ast, without importing this file)
LINES: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


def write_log(out_dir: str, name: str) -> None:
    """Everything logged so far into out_dir/name."""
    with open(os.path.join(out_dir, name), "w") as f:
        f.write("\n".join(LINES) + "\n")


def make(b, ctx, hkv, group, d, page, int8):
    lens = [ctx] * b if isinstance(ctx, int) else ctx
    nbs = [triton.cdiv(n, page) for n in lens]
    nb = sum(nbs)
    perm = torch.randperm(nb, device="cuda").int()
    table = torch.zeros(b, max(nbs), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(nbs):
        table[i, :n] = perm[used:used + n]
        used += n
    shape = (nb, page, hkv, d)
    if int8:
        k = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
        v = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
        ks = (torch.rand(nb, hkv, page, device="cuda") * 0.02 + 0.001).half()
        vs = (torch.rand(nb, hkv, page, device="cuda") * 0.02 + 0.001).half()
        nbytes = 2 * k.numel() + 2 * ks.numel() * ks.element_size()
    else:
        k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        ks = vs = None
        nbytes = 2 * k.numel() * 2
    q = torch.randn(b, hkv * group, d, dtype=torch.bfloat16, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return (q, k, v, ks, vs, table, lens_t), nbytes * sum(lens) / (nb * page)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def sdpa_ms(b, ctx, hkv, group, d) -> float:
    q = torch.randn(b, hkv * group, 1, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, hkv, ctx, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(b, hkv, ctx, d, dtype=torch.bfloat16, device="cuda")
    return bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def correctness(int8_only: bool = False) -> None:
    cases = [  # (lens, hkv, group, d, page, int8, splits)
        ([1, 17, 1000, 4095, 333], 8, 4, 128, 16, True, None),
        ([1, 17, 1000, 4095, 333], 8, 4, 128, 16, False, None),
        ([4096] * 64, 8, 4, 128, 16, True, 1),
        ([32768], 8, 4, 128, 16, True, None),
        ([32768], 8, 4, 128, 16, False, None),
        ([7, 2000, 513], 4, 8, 64, 32, True, 5),
        ([7, 2000, 513], 2, 16, 128, 16, True, 3),
        ([7, 2000, 513], 8, 1, 128, 16, False, 1),
    ]
    for lens, hkv, group, d, page, int8, splits in cases:
        if int8_only and not int8:
            continue
        args, _ = make(len(lens), lens, hkv, group, d, page, int8)
        scale = d ** -0.5
        out = torch.full_like(args[0], float("nan"))
        td.paged_decode(*args, scale, num_splits=splits, out=out)
        ref = paged_attention_decode(args[0].float(), *args[1:], scale)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ok = bool(torch.isfinite(out).all()) and err < 1e-2
        log(f"check lens={lens[:5]} hkv={hkv} g={group} d={d} page={page} int8={int8} "
            f"splits={splits}: rel_l2={err:.2e} {'OK' if ok else 'FAIL'}")


class Capture:
    """Stands in for the stage-1 kernel to keep the compiled kernel a launch returns."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.last = self.kernel[grid](*a, **kw)
            return self.last
        return launch


def ptx_report(args, tag: str, out_dir: str, **kw) -> None:
    cap = Capture(td._decode_stage1)
    td._decode_stage1 = cap
    try:
        td.paged_decode(*args, 0.1, **kw)
    finally:
        td._decode_stage1 = cap.kernel
    c = cap.last
    ptx = c.asm["ptx"]
    with open(os.path.join(out_dir, f"stage1_{tag}.ptx"), "w") as f:
        f.write(ptx)
    cvts: dict[str, int] = {}
    for line in ptx.splitlines():
        tok = line.strip().split(" ")[0]
        if tok.startswith("cvt") or tok.startswith("prmt") or tok.startswith("mma") or \
                tok.startswith("sub.bf16") or tok.startswith("fma.rn.bf16"):
            cvts[tok] = cvts.get(tok, 0) + 1
    log(f"ptx {tag}: regs={getattr(c, 'n_regs', '?')} spills={getattr(c, 'n_spills', '?')} "
        f"smem={getattr(c.metadata, 'shared', '?')} ops={cvts}")


def sweep(name, b, ctx, hkv, group, d, page, int8, variants, sdpa, check: bool = False):
    """Times each variant; `check`: also compares each with the fp32 reference."""
    args, nbytes = make(b, ctx, hkv, group, d, page, int8)
    scale = d ** -0.5
    out = torch.empty_like(args[0])
    ref = paged_attention_decode(args[0].float(), *args[1:], scale) if check else None
    rows = []
    for variant in variants:
        bn, st, sp, nw = variant[:4]
        regs = variant[4] if len(variant) > 4 else None
        asm = variant[5] if len(variant) > 5 else True
        cfg = None if bn is None else td.DecodeConfig(bn, nw, st, regs, asm)
        if sp is None:
            sp_used = td.default_num_splits(b, hkv, ctx, td._sm_count(0))
        else:
            sp_used = sp
        try:
            ms = bench(lambda: td.paged_decode(*args, scale, num_splits=sp_used, out=out,
                                               config=cfg))
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported
            log(f"{name} {variant}: ERROR {type(e).__name__} {e}"[:300])
            continue
        err = float("nan")
        if ref is not None:
            out.fill_(float("nan"))
            td.paged_decode(*args, scale, num_splits=sp_used, out=out, config=cfg)
            err = ((out.float() - ref).norm() / ref.norm()).item()
        rows.append((ms, bn or 0, st or 0, sp_used, nw or 0))
        tag = "default" if bn is None else f"r{regs}" + ("" if asm else " noasm")
        log(f"{name:20s} BN={bn} st={st} splits={sp_used:3d} w={nw} {tag:9s} {ms:.4f} ms "
            f"{nbytes / ms / 1e9:.2f} TB/s  x{sdpa / ms:.2f} vs SDPA  err {err:.1e}")
    best = min(rows)
    log(f"BEST {name}: BN={best[1]} st={best[2]} splits={best[3]} w={best[4]} {best[0]:.4f} ms "
        f"{nbytes / best[0] / 1e9:.2f} TB/s x{sdpa / best[0]:.2f}")
    return args


def main_v2(out_dir: str) -> None:
    """int8 only, after the inline-PTX V conversion; SDPA times from the first run."""
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    correctness(int8_only=True)
    gate_sdpa, long_sdpa, short_sdpa = 0.2548, 0.0500, 0.1382
    gate = [(None, None, None, None), (64, 2, 1, 4), (64, 3, 2, 4), (64, 3, 1, 4, 128),
            (64, 2, 1, 4, 128), (128, 3, 1, 4), (128, 3, 2, 4), (128, 2, 1, 8), (32, 3, 1, 4),
            (32, 4, 2, 4), (64, 3, 1, 4, None, False)]
    args = sweep("B64 ctx4096 int8", 64, 4096, 8, 4, 128, 16, True, gate, gate_sdpa)
    ptx_report(args, "gate_int8_v2", out_dir, num_splits=1)
    sweep("B1 ctx32768 int8", 1, 32768, 8, 4, 128, 16, True,
          [(None, None, None, None), (64, 3, 64, 4), (128, 3, 32, 4), (128, 2, 64, 4),
           (64, 3, 32, 4, 128)], long_sdpa)
    sweep("B256 ctx512 int8", 256, 512, 8, 4, 128, 16, True,
          [(None, None, None, None), (32, 3, 1, 4), (64, 3, 1, 4, 128)], short_sdpa)
    write_log(out_dir, "decode_variants_v2.txt")


def main_v3(out_dir: str) -> None:
    """Register cap, grid order (kv head fastest vs sequence fastest), inline-PTX V on/off."""
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    correctness(int8_only=False)
    gate_sdpa, long_sdpa, short_sdpa = 0.2548, 0.0500, 0.1382
    gate = [(None, None, None, None), (64, 2, 1, 4, 128), (64, 2, 1, 4, 128, False),
            (128, 3, 1, 4), (128, 3, 1, 4, None, False), (64, 3, 1, 4, 128), (64, 2, 2, 4, 128),
            (64, 2, 8, 4, 128), (128, 3, 4, 4)]
    sweep("B64 ctx4096 int8", 64, 4096, 8, 4, 128, 16, True, gate, gate_sdpa, check=True)
    sweep("B1 ctx32768 int8", 1, 32768, 8, 4, 128, 16, True,
          [(128, 3, 32, 4), (128, 3, 32, 4, None, False), (64, 2, 64, 4, 128),
           (64, 2, 128, 4, 128), (128, 3, 64, 4)], long_sdpa, check=True)
    sweep("B256 ctx512 int8", 256, 512, 8, 4, 128, 16, True,
          [(64, 2, 1, 4, 128), (128, 3, 1, 4), (64, 2, 1, 4, 128, False)], short_sdpa, check=True)
    sweep("B64 ctx4096 bf16", 64, 4096, 8, 4, 128, 16, False,
          [(None, None, None, None), (128, 3, 1, 4)], gate_sdpa, check=True)
    sweep("B1 ctx32768 bf16", 1, 32768, 8, 4, 128, 16, False, [(128, 3, 32, 4)], long_sdpa, check=True)
    write_log(out_dir, "decode_variants_v3.txt")


def main_d64(out_dir: str) -> None:
    """Head dim 64 (Llama-3.2-1B: Hq 32, Hkv 8): the engine's decode shape, which the launch table
    had not been measured on. B 256 x ctx 512 is the offline benchmark's steady state."""
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    correctness(int8_only=True)
    int8 = [(None, None, None, None), (64, 3, 1, 4), (128, 2, 1, 4), (128, 4, 1, 4), (256, 2, 1, 4),
            (256, 3, 1, 4), (256, 3, 1, 8), (128, 3, 1, 8), (512, 2, 1, 8), (128, 3, 1, 4, None, False),
            (256, 3, 1, 4, None, False)]
    bf16 = [(None, None, None, None), (64, 2, 1, 4), (128, 3, 1, 4), (256, 2, 1, 8)]
    for b, ctx in ((256, 512), (64, 4096)):
        sdpa = sdpa_ms(b, ctx, 8, 4, 64)
        sweep(f"B{b} ctx{ctx} d64 int8", b, ctx, 8, 4, 64, 16, True, int8, sdpa, check=True)
        sweep(f"B{b} ctx{ctx} d64 bf16", b, ctx, 8, 4, 64, 16, False, bf16, sdpa, check=True)
    write_log(out_dir, "decode_variants_d64.txt")


def bench_graph(fn, calls: int = 50) -> float:
    """ms per call replayed from one CUDA graph of `calls` calls (how the engine runs decode)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main_engine(out_dir: str) -> None:
    """The engine's decode shapes after issue 14's kernel changes (fp16 scales, padded head dims,
    shared tile code): Llama-3.2-1B (D 64, B 256, ctx 400) and Qwen3-4B (D 128); one long
    sequence timed from a CUDA graph, as the engine replays decode."""
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    correctness(int8_only=False)
    d64_int8 = [(None, None, None, None), (32, 2, 1, 2), (64, 2, 1, 2), (128, 2, 1, 2), (128, 3, 1, 2)]
    d64_bf16 = [(None, None, None, None), (64, 2, 1, 2), (128, 2, 1, 2), (32, 2, 1, 2)]
    for b, ctx in ((256, 400), (64, 4096)):
        sdpa = sdpa_ms(b, ctx, 8, 4, 64)
        sweep(f"L1B B{b} ctx{ctx} int8", b, ctx, 8, 4, 64, 16, True, d64_int8, sdpa)
        sweep(f"L1B B{b} ctx{ctx} bf16", b, ctx, 8, 4, 64, 16, False, d64_bf16, sdpa)
    d128_int8 = [(None, None, None, None), (32, 2, 1, 2), (64, 2, 1, 2), (128, 2, 1, 2), (64, 3, 1, 2)]
    for b, ctx in ((64, 4096), (256, 512)):
        sdpa = sdpa_ms(b, ctx, 8, 4, 128)
        sweep(f"Q4B B{b} ctx{ctx} int8", b, ctx, 8, 4, 128, 16, True, d128_int8, sdpa)
        sweep(f"Q4B B{b} ctx{ctx} bf16", b, ctx, 8, 4, 128, 16, False,
              [(None, None, None, None), (64, 2, 1, 2)], sdpa)
    args, nbytes = make(1, 32768, 8, 4, 128, 16, True)
    out = torch.empty_like(args[0])
    for bn, st, sp, nw in ((None, None, None, None), (64, 2, 64, 2), (64, 2, 128, 2), (128, 2, 64, 2),
                           (32, 2, 128, 2)):
        cfg = None if bn is None else td.DecodeConfig(bn, nw, st)
        splits = sp or td.default_num_splits(1, 8, 32768, td._sm_count(0))
        ms = bench_graph(lambda: td.paged_decode(*args, 0.1, num_splits=splits, out=out, config=cfg))
        log(f"B1 ctx32768 int8 graph BN={bn} st={st} w={nw} splits={splits}: {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s")
    write_log(out_dir, "decode_variants_engine.txt")


def copy_ms(nbytes: int = 2 ** 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    c = torch.empty_like(a)
    return bench(lambda: c.copy_(a))


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    rounds = ap.add_mutually_exclusive_group()
    rounds.add_argument("--v2", action="store_true",
                        help="instead of the first sweep: int8 only, after the inline-PTX V conversion")
    rounds.add_argument("--v3", action="store_true",
                        help="instead of the first sweep: register cap, grid order, inline-PTX V on/off "
                             "(every variant checked against the fp32 reference)")
    rounds.add_argument("--d64", action="store_true",
                        help="instead of the first sweep: head dim 64, the Llama-3.2-1B decode shape "
                             "(every variant checked against the fp32 reference)")
    rounds.add_argument("--engine", action="store_true",
                        help="instead of the first sweep: the engine's decode shapes after issue 14, "
                             "one long sequence replayed from a CUDA graph")
    ap.add_argument("--quick", action="store_true", help="the first sweep with a few variants only")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder for the log and the PTX (default: $OUT where set, else /tmp)")
    args = ap.parse_args(argv)
    require_cuda(ap)
    out_dir = args.out or os.environ.get("OUT", "/tmp")
    for mode, run in (("engine", main_engine), ("d64", main_d64), ("v3", main_v3), ("v2", main_v2)):
        if getattr(args, mode):
            run(out_dir)
            return 0
    main_sweep(args.quick, out_dir)
    return 0


def main_sweep(quick: bool, out_dir: str) -> None:
    """The first round: a grid of (BLOCK_N, stages, splits) at three shapes, int8 and bf16."""
    torch.manual_seed(0)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    log(f"copy 1 GiB: {copy_ms():.3f} ms")
    correctness()

    gate_sdpa = sdpa_ms(64, 4096, 8, 4, 128)
    long_sdpa = sdpa_ms(1, 32768, 8, 4, 128)
    short_sdpa = sdpa_ms(256, 512, 8, 4, 128)
    log(f"SDPA bf16 contiguous: B64 ctx4096 {gate_sdpa:.4f} ms; B1 ctx32768 {long_sdpa:.4f} ms; "
        f"B256 ctx512 {short_sdpa:.4f} ms")

    dflt = [(None, None, None, None)]
    grid = [(bn, st, sp, 4) for bn in (32, 64, 128) for st in (2, 3, 4) for sp in (1, 2)]
    grid += [(64, 3, 4, 4), (128, 3, 1, 8), (128, 2, 1, 8)]
    if quick:
        grid = [(64, 3, 1, 4), (128, 2, 1, 4)]
    for int8 in (True, False):
        kind = "int8" if int8 else "bf16"
        gate_args = sweep(f"B64 ctx4096 {kind}", 64, 4096, 8, 4, 128, 16, int8, dflt + grid,
                          gate_sdpa)
        ptx_report(gate_args, f"gate_{kind}", out_dir, num_splits=1)
        long_grid = [(bn, st, sp, 4) for bn in (64, 128) for st in (3,)
                     for sp in (8, 16, 32, 48, 64, 96)]
        sweep(f"B1 ctx32768 {kind}", 1, 32768, 8, 4, 128, 16, int8,
              dflt + (long_grid[:2] if quick else long_grid), long_sdpa)
        sweep(f"B256 ctx512 {kind}", 256, 512, 8, 4, 128, 16, int8,
              dflt + [(64, 3, 1, 4), (32, 3, 1, 4), (64, 3, 2, 4)], short_sdpa)
    write_log(out_dir, "decode_variants.txt")


if __name__ == "__main__":
    sys.exit(main())
