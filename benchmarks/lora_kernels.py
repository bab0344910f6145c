"""The gathered LoRA kernels on the GPU (issue 61): their time per projection and per step, beside
the base projections they add to, for each way of launching them.

    python -m benchmarks.lora_kernels                      # qwen2-7b shape, 256 and 8,192 rows, 1 and 8 slots
    python -m benchmarks.lora_kernels --variants chunks,gemm
    python -m benchmarks.lora_kernels --shape llama-1b --tokens 64,256 --rank 64

For each projection of the shape (qkv, o, gate_up, down: the fused ones' banks hold a rank's rows
per part, as LoraBank does) and each step of T rows spread round-robin over S slots: the base GEMM
(x W^T, cuBLAS) and `lora_delta_`, each timed by `attention.bench_graph` (back-to-back calls
replayed from one CUDA graph), the deltas first checked against the torch twin. The variants
(`--variants`, the kernels' own options, kernels/triton_lora.py):

    chunks     the shipped launch: shrink over K chunks, reduce, expand; 16 rows a program
    whole-k    the shrink with the whole K in one program (no reduce): what the chunks replaced
    gemm       t of every slot from one library GEMM, then the expand
    chunks-t64, gemm-t64   the same with 64 rows a program
    masked     library GEMMs only: t_all = x . A_all^T (T, S R), each row's other slots' columns
               zeroed by the step's one-hot (T, S) (made once per step, not timed), y += t_all .
               B_all^T with B_all (N, S R) every slot's B side by side (addmm, beta 1)

and one candidate not in kernels/triton_lora.py:

    augmented  y = [x | t_all * onehot] . [W | B_all]^T: the base projection and the delta in one
               GEMM over K + S R columns (the base weight a view of the wider matrix), so y is
               written once; timed with the copy of x into the wide input (a producer could write
               there), its LoRA figure is its time less the base GEMM's

The table gives the microseconds of each and, per step, the layers' sum: the LoRA kernels' time as
a share of the base projections' (the ≤ 5% that issue 61's throughput target leaves them).
"""

from __future__ import annotations

import sys

import torch

from benchmarks.common import make_parser, require_cuda
from benchmarks.mixed import SHAPES

NEEDS_GPU = True  # read by `pie bench` (with ast, without importing this file)


def projections(shape: str, rank: int) -> dict[str, tuple[int, int, int]]:
    """name: (K, N, rank rows of the bank) of a shape of benchmarks/mixed.py."""
    c = SHAPES[shape][1]
    hidden, inter, hq, hkv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim", hidden // hq)
    return {"qkv": (hidden, (hq + 2 * hkv) * d, 3 * rank), "o": (hq * d, hidden, rank),
            "gate_up": (hidden, 2 * inter, 2 * rank), "down": (inter, hidden, rank)}


# variant: (K_CHUNK or None for the whole K, shrink, rows per program)
VARIANTS = {"chunks": (512, "chunks", 16), "whole-k": (None, "chunks", 16), "gemm": (512, "gemm", 16),
            "chunks-t64": (512, "chunks", 64), "gemm-t64": (512, "gemm", 64), "masked": (512, "masked", 16)}
LIBRARY = ("augmented",)  # the candidate outside the kernels' module (module docstring)


def library_call(label: str, x, w, a, b, y, onehot):
    """The timed call of a LIBRARY variant; it leaves x W^T plus the delta in y."""
    assert label == "augmented", label
    t_rows, k = x.shape
    s, rows, _ = a.shape
    n = w.shape[0]
    a_all = a.reshape(s * rows, k)
    b_all = b.permute(1, 0, 2).reshape(n, s * rows).contiguous()
    mask = onehot[:, :, None]
    wide_w = torch.cat([w, b_all], dim=1)  # (N, K + S R): W is wide_w[:, :K]
    wide_x = torch.empty(t_rows, k + s * rows, dtype=x.dtype, device=x.device)

    def call():
        wide_x[:, :k].copy_(x)
        t = torch.mm(x, a_all.T).view(t_rows, s, rows)
        torch.mul(t, mask, out=wide_x[:, k:].view(t_rows, s, rows))
        return torch.mm(wide_x, wide_w.T, out=y)
    return call


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b", help="model shape (benchmarks/mixed.py)")
    ap.add_argument("--tokens", default="256,8192", help="rows per step (a decode batch, a prefill chunk)")
    ap.add_argument("--slots", default="1,8", help="adapters the rows are spread over")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--variants", default=",".join([*VARIANTS, *LIBRARY]),
                    help="launch variants to time, comma-separated: " + ", ".join([*VARIANTS, *LIBRARY]))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS) - set(LIBRARY))
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join([*VARIANTS, *LIBRARY])})")
    require_cuda(ap)
    from benchmarks.attention import bench_graph
    from pie.kernels import triton_lora as tlo

    layers = SHAPES[args.shape][1]["num_hidden_layers"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shipped_chunk = tlo.K_CHUNK
    print(f"# {torch.cuda.get_device_name()}, {args.shape}, rank {args.rank}, bf16; microseconds per call "
          f"(CUDA graph replay), K_CHUNK {shipped_chunk}")
    print("| T | slots | variant | qkv base / LoRA | o base / LoRA | gate_up base / LoRA | down base / LoRA "
          "| per step: base / LoRA (LoRA / base) |")
    print("|---|---|---|---|---|---|---|---|")
    for t in (int(v) for v in args.tokens.split(",")):
        for s in (int(v) for v in args.slots.split(",")):
            slots = (torch.arange(t, device="cuda", dtype=torch.int32) % s).contiguous()
            onehot = (slots[:, None] == torch.arange(s, device="cuda")[None, :]).to(torch.bfloat16)
            for label in variants:
                library = label in LIBRARY
                chunk, shrink, block_t = VARIANTS.get(label, VARIANTS["chunks"])
                tlo.K_CHUNK = chunk or 1 << 20
                kw = dict(shrink=shrink, block_t=block_t)
                if shrink == "masked":
                    kw["onehot"] = onehot
                cells, base_sum, lora_sum = [], 0.0, 0.0
                for k, n, rows in projections(args.shape, args.rank).values():
                    x = torch.randn(t, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5
                    a = torch.randn(s, rows, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5
                    # B at the scale of y's own entries: a delta much smaller than y's rounding
                    # could go missing unseen by the check below
                    b = torch.randn(s, n, rows, device="cuda", generator=gen, dtype=torch.bfloat16) / rows ** 0.5
                    if shrink == "masked":  # its B bank stored (N, S, R)
                        b = tlo.wide_b_bank(s, n, rows, dtype=b.dtype, device="cuda").copy_(b)
                    y = x @ w.T
                    want = tlo.lora_delta_reference_(y.clone(), x, a, b, slots)
                    if library:
                        got = library_call(label, x, w, a, b, y.clone(), onehot)()
                    else:
                        got = tlo.lora_delta_(y.clone(), x, a, b, slots, **kw)
                    # relative to the delta itself: y's own size would hide a wrong delta
                    delta = (want.float() - y.float()).abs().max()
                    err = ((got.float() - want.float()).abs().max() / delta).item()
                    assert err < 5e-2, f"{label} {k}x{n}, T {t}, {s} slots: error {err:.2e} of the delta's size"
                    order = tlo.slot_order(slots)
                    base_us = 1e3 * bench_graph(lambda x=x, w=w, y=y: torch.matmul(x, w.T, out=y))
                    if library:
                        lora_us = 1e3 * bench_graph(library_call(label, x, w, a, b, y, onehot))
                        if label == "augmented":
                            lora_us -= base_us  # its call is the base projection and the delta
                    else:
                        lora_us = 1e3 * bench_graph(lambda y=y, x=x, a=a, b=b, kw=kw: tlo.lora_delta_(
                            y, x, a, b, slots, order, **kw))
                    cells.append(f"{base_us:.1f} / {lora_us:.1f}")
                    base_sum += base_us
                    lora_sum += lora_us
                print(f"| {t} | {s} | {label} | {' | '.join(cells)} | {layers * base_sum / 1e3:.2f} / "
                      f"{layers * lora_sum / 1e3:.2f} ms ({100 * lora_sum / base_sum:.1f}%) |", flush=True)
    tlo.K_CHUNK = shipped_chunk
    return 0


if __name__ == "__main__":
    sys.exit(main())
