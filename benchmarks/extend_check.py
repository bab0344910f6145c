"""GPU check and timing of the Triton extend and cache-write kernels (one device call).

    python3 -m benchmarks.extend_check [--out DIR]

1. Correctness: bf16 q over int8 and bf16 paged caches (GQA 4) against the fp32 torch reference.
2. Extend timing: 4k-token prompts (Hq 32, Hkv 8, D 128, page 16; B = 1 and 4, plus a 512-token
   chunk after a 3.5k prefix) against torch SDPA causal on contiguous bf16, over a few tile
   configurations (BLOCK_M, BLOCK_N, warps, stages).
3. Cache-write timing: T = 4096 / 16384 tokens from a fused qkv slice into int8 / bf16 caches.
4. Chunk bits: a 1,000-token prompt attended whole and in chunks of 64, 100 and 1 tokens (every key
   from the cache), per int8 mode, with the compiler's FMA fusion on and off: the chunks whose
   output differs from the whole prompt's in any bit (4 random draws), and the kernel's time with
   fusion on and off (the engine runs it off: paged_extend's docstring says why).
Times: medians of triton.testing.do_bench (L2 flushed between runs). A markdown table goes to
stdout and to DIR/extend_check.md.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import make_parser, require_cuda
from pie.kernels import reference as ref
from pie.kernels.triton_cache_write import write_kv_cache
from pie.kernels.triton_extend import paged_extend

NEEDS_GPU = True  # read by `pie bench` (with ast, without importing this file)
HQ, HKV, D, PAGE = 32, 8, 128, 16
CONFIGS = {  # (BLOCK_M, BLOCK_N, warps, stages, int8 (k_mode, v_mode)) tried at B=1; None = the default
    torch.bfloat16: [None],
    torch.int8: [None, (128, 128, 8, 2, ("cast", "cast")), (128, 64, 8, 2, ("imma", "bias")),
                 (128, 32, 8, 2, ("bias", "bias")), (64, 64, 4, 2, ("imma", "bias"))],
}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def paged(k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], dtype: torch.dtype):
    """k, v (B, L, Hkv, D) -> cache, scales and shuffled block tables holding seq_lens[i] tokens."""
    b, length = k.shape[:2]
    pages = -(-length // PAGE)
    num_blocks = b * pages + 7
    perm = torch.randperm(num_blocks, device="cuda")
    tables = perm[: b * pages].view(b, pages).int().contiguous()
    shape = (num_blocks, PAGE, HKV, D)
    kc = torch.zeros(shape, dtype=dtype, device="cuda")
    vc = torch.zeros(shape, dtype=dtype, device="cuda")
    ks = vs = None
    if dtype == torch.int8:
        ks = torch.zeros(num_blocks, HKV, PAGE, dtype=torch.float16, device="cuda")
        vs = torch.zeros(num_blocks, HKV, PAGE, dtype=torch.float16, device="cuda")
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s, device="cuda")
        slots = tables[i, pos // PAGE].long() * PAGE + pos % PAGE
        write_kv_cache(k[i, :s], v[i, :s], kc, vc, ks, vs, slots)
    return kc, vc, ks, vs, tables


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def correctness(rows: list[str]) -> bool:
    ok = True
    seq_lens, q_lens = [1000, 517, 300, 77, 1, 2048], [1000, 130, 1, 77, 1, 333]
    b = len(seq_lens)
    k = torch.randn(b, max(seq_lens), HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    sl = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
    for dtype in (torch.int8, torch.bfloat16):
        kc, vc, ks, vs, tables = paged(k, v, seq_lens, dtype)
        want = ref.paged_attention(q.float(), kc, vc, ks, vs, tables, sl, qsl, D ** -0.5)
        out = torch.full_like(q, float("nan"))
        paged_extend(q, kc, vc, ks, vs, tables, sl, qsl, D ** -0.5, max_query_len=max(q_lens),
                     out=out)
        err = rel(out, want)
        good = not bool(out.isnan().any()) and err < 1e-2
        ok &= good
        rows.append(f"| correctness bf16 q, {dtype} cache, GQA 4, mixed batch | rel err "
                    f"{err:.2e} | {'ok' if good else 'FAIL'} |")
    return ok


def extend_rows(rows: list[str]) -> None:
    scale = D ** -0.5
    flops_of = lambda b, lq, s: 4 * b * HQ * D * (lq * s - lq * (lq - 1) / 2)  # noqa: E731
    cases = [(1, 4096, 4096), (4, 4096, 4096), (4, 512, 4096)]  # (B, q_len, seq_len)
    for b, lq, s in cases:
        k = torch.randn(b, s, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qd = torch.randn(b, HQ, lq, D, device="cuda", dtype=torch.bfloat16)  # SDPA layout
        kd = k.transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()  # (B, Hq, S, D)
        vd = v.transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()
        if lq == s:
            sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)  # noqa
        else:  # a chunk after a prefix: bottom-right aligned causal mask
            mask = (torch.arange(s, device="cuda")[None, :]
                    <= torch.arange(s - lq, s, device="cuda")[:, None])
            sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)  # noqa
        t_sdpa = bench(sdpa)
        sdpa_out = sdpa().transpose(1, 2).reshape(b * lq, HQ, D)
        tf = flops_of(b, lq, s) / 1e12
        rows.append(f"| SDPA bf16 contiguous B={b} q={lq} ctx={s} | {t_sdpa:.3f} ms | "
                    f"{tf / t_sdpa * 1e3:.0f} TFLOP/s |")
        q = qd.transpose(1, 2).reshape(b * lq, HQ, D).contiguous()
        qsl = torch.arange(0, b * lq + 1, lq, device="cuda", dtype=torch.int32)
        sl = torch.full((b,), s, device="cuda", dtype=torch.int32)
        for dtype in (torch.bfloat16, torch.int8):
            kc, vc, ks, vs, tables = paged(k, v, [s] * b, dtype)
            for cfg in CONFIGS[dtype] if b == 1 else [None]:
                bm, bn, w, st, modes = cfg or (None,) * 5
                fn = lambda: paged_extend(q, kc, vc, ks, vs, tables, sl, qsl, scale,  # noqa
                                          max_query_len=lq, block_m=bm, block_n=bn,
                                          num_warps=w, num_stages=st, int8_modes=modes)
                try:
                    err = rel(fn(), sdpa_out)
                    t = bench(fn)
                except Exception as exc:  # a config that does not compile / fit
                    rows.append(f"| extend {dtype} B={b} q={lq} ctx={s} cfg={cfg} | error | "
                                f"{type(exc).__name__}: {str(exc)[:80]} |")
                    continue
                name = f"{str(dtype)[6:]} B={b} q={lq} ctx={s} cfg={cfg or 'default'}"
                rows.append(f"| extend {name} | "
                            f"{t:.3f} ms | {t / t_sdpa:.2f}x SDPA, {tf / t * 1e3:.0f} TFLOP/s, "
                            f"err vs SDPA {err:.1e} |")
            if lq == s:  # no cached prefix: the engine passes the new K/V as computed (k_new)
                kn = k.reshape(b * s, HKV, D)
                vn = v.reshape(b * s, HKV, D)
                fn = lambda: paged_extend(q, kc, vc, ks, vs, tables, sl, qsl, scale, max_query_len=lq,  # noqa
                                          k_new=kn, v_new=vn)
                err = rel(fn(), sdpa_out)
                t = bench(fn)
                rows.append(f"| extend {str(dtype)[6:]} pages, k_new (no cached prefix) B={b} q={lq} | {t:.3f} ms | "
                            f"{t / t_sdpa:.2f}x SDPA, err vs SDPA {err:.1e} |")
        del kd, vd


def cache_write_rows(rows: list[str]) -> None:
    for t in (4096, 16384):
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
        num_blocks = t // PAGE + 8
        slots = torch.randperm(num_blocks * PAGE, device="cuda")[:t]
        for dtype in (torch.int8, torch.bfloat16):
            kc = torch.zeros(num_blocks, PAGE, HKV, D, dtype=dtype, device="cuda")
            vc = torch.zeros_like(kc)
            ks = vs = None
            if dtype == torch.int8:
                ks = torch.zeros(num_blocks, HKV, PAGE, device="cuda", dtype=torch.float16)
                vs = torch.zeros_like(ks)
            fn = lambda: write_kv_cache(k, v, kc, vc, ks, vs, slots)  # noqa: E731
            fn()
            want = [x.clone() if x is not None else None for x in (kc, vc, ks, vs)]
            ref.write_kv_cache(k, v, *want, slots)
            exact = all(torch.equal(a, b) for a, b in zip((kc, vc, ks, vs), want)
                        if a is not None)
            if not exact:
                for name, a, b in zip("kv", (kc, vc, ks, vs), want):
                    print(f"{name}: {int((a != b).sum())} values differ, max "
                          f"{int((a.int() - b.int()).abs().max())}")
                if ks is not None:
                    print(f"scales differ: {int((ks != want[2]).sum())} of {ks.numel()}")
            ms = bench(fn)
            t_ref = bench(lambda: ref.write_kv_cache(k, v, kc, vc, ks, vs, slots))
            nbytes = 2 * t * HKV * D * (2 + kc.element_size()) + (
                2 * t * HKV * 4 if ks is not None else 0) + t * 8
            rows.append(f"| cache write {str(dtype)[6:]} T={t} | {ms * 1e3:.1f} us | "
                        f"{nbytes / ms / 1e6:.0f} GB/s, torch ref {t_ref * 1e3:.1f} us, "
                        f"{'bit-exact' if exact else 'MISMATCH'} |")


def chunk_bits_rows(rows: list[str]) -> None:
    n = 1000
    chunks = [(lo, min(n, lo + c)) for c in (64, 100) for lo in (0, 300, 517, 999)] + [(5, 6), (700, 701), (998, 999)]
    for dtype, modes in ((torch.int8, None), (torch.int8, ("imma", "bias")), (torch.int8, ("bias", "bias")),
                         (torch.bfloat16, None)):
        for fusion in (True, False):
            unequal, worst = [], 0.0
            for _ in range(4):
                k = torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16)
                kc, vc, ks, vs, tables = paged(k, torch.randn_like(k), [n], dtype)
                q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)

                def attend(lo: int, hi: int) -> torch.Tensor:
                    out = torch.full_like(q[lo:hi], float("nan"))
                    return paged_extend(q[lo:hi], kc, vc, ks, vs, tables, torch.tensor([hi], device="cuda", dtype=torch.int32),
                                        torch.tensor([0, hi - lo], device="cuda", dtype=torch.int32), D ** -0.5,
                                        max_query_len=n, out=out, int8_modes=modes, fp_fusion=fusion)

                whole = attend(0, n)
                parts = [(attend(lo, hi), whole[lo:hi]) for lo, hi in chunks]
                diffs = [(got.float() - want.float()).abs().max().item() for got, want in parts
                         if not torch.equal(got, want)]
                unequal.append(len(diffs))
                worst = max([worst, *diffs])
            rows.append(f"| chunk bits, {str(dtype)[6:]} pages, modes {modes or 'default'}, fp fusion "
                        f"{'on' if fusion else 'off'} | - | chunks unequal to the whole prompt, of {len(chunks)} per "
                        f"draw: {unequal}, worst {worst:.2e} |")
    for dtype in (torch.int8, torch.bfloat16):
        for ctx, lq, new_kv in ((4096, 4096, False), (0, 4096, True), (8192, 512, False)):
            s = ctx + lq
            k = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            kc, vc, ks, vs, tables = paged(k, v, [s], dtype)
            q = torch.randn(lq, HQ, D, device="cuda", dtype=torch.bfloat16)
            kn, vn = (k[0, ctx:], v[0, ctx:]) if new_kv else (None, None)
            sl = torch.tensor([s], device="cuda", dtype=torch.int32)
            qsl = torch.tensor([0, lq], device="cuda", dtype=torch.int32)
            times = [bench(lambda f=f: paged_extend(q, kc, vc, ks, vs, tables, sl, qsl, D ** -0.5, max_query_len=lq,
                                                     k_new=kn, v_new=vn, fp_fusion=f)) for f in (True, False)]
            rows.append(f"| extend {str(dtype)[6:]} pages, {lq} new after {ctx} cached{', k_new' if new_kv else ''}: "
                        f"fp fusion on / off | {times[0]:.3f} / {times[1]:.3f} ms | off costs {times[1] / times[0]:.3f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="folder for extend_check.md (default: $OUT where set, else the current folder)")
    args = parser.parse_args(argv)
    require_cuda(parser)
    out_dir = args.out or os.environ.get("OUT", ".")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = ["| what | time | notes |", "|---|---|---|"]
    ok = correctness(rows)
    cache_write_rows(rows)
    print("\n".join(rows), flush=True)
    extend_rows(rows)
    chunk_bits_rows(rows)
    table = "\n".join(rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}\n{table}")
    with open(os.path.join(out_dir, "extend_check.md"), "w") as f:
        f.write(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
