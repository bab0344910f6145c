"""Nsight Compute profile of the paged decode kernel (`_decode_stage1`), one launch per case.

On the GPU machine (`ncu` on the PATH), from the repo root:

    python3 -m benchmarks.ncu_decode --profile [--cases int8:old,int8:default,bf16:default] [--out DIR]

runs itself under `ncu --set full --clock-control none` (every case launched once to compile,
then once profiled; the raw metrics go to DIR/ncu_raw.csv) and prints one markdown table: DRAM
throughput, issue slots busy, registers and warps per block, local-memory (spill) requests, shared
memory per block and the limiting resource, theoretical / achieved warps per SM, shared-store and
-load bank conflicts, instructions executed and the top stall reasons. `--report CSV` prints the
table of an existing raw CSV. A case is `DTYPE:VARIANT[@SHAPE]`: DTYPE int8 or bf16, VARIANT a
name of benchmarks/decode_variants.py (or `default`, the launch table), SHAPE `BxCTXxD`
(default 64x4096x128).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

NEEDS_GPU = False  # read by `pie bench`: --report runs anywhere; --profile checks for a GPU itself
DEFAULT_CASES = ("int8:old,int8:default,bf16:default,int8:old@256x400x64,int8:default@256x400x64,"
                 "bf16:default@256x400x64")


def parse_case(case: str):
    kind, _, rest = case.partition(":")
    variant, _, shape = rest.partition("@")
    b, ctx, d = (int(x) for x in (shape or "64x4096x128").split("x"))
    return kind, variant, b, ctx, d


def launch_cases(cases: list[str]) -> None:
    """Every case once on a small batch (compiles), then once at its shape: the launches ncu
    profiles, each case's inputs freed before the next (ncu saves and restores device memory)."""
    import torch

    import pie.kernels.triton_decode as td
    from benchmarks.decode_variants import BF16, VARIANTS, make

    for warm in (True, False):
        for case in cases:
            kind, variant, b, ctx, d = parse_case(case)
            cfg = None if variant == "default" else (VARIANTS | BF16)[variant]
            if warm:
                b, ctx = 2, 300
            args, _ = make([ctx] * b, d, kind == "int8")
            out = torch.empty_like(args[0])
            td.paged_decode(*args, d ** -0.5, max_seq_len=ctx, num_splits=1, out=out, config=cfg)
            torch.cuda.synchronize()
            del args, out


# (column, metric names tried in order; the first present wins)
COLUMNS = [
    ("time us", ["gpu__time_duration.sum"]),
    ("DRAM %", ["dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("DRAM TB/s", ["dram__bytes.sum.per_second"]),
    ("issue busy %", ["sm__inst_issued.avg.pct_of_peak_sustained_active",
                      "smsp__issue_active.avg.pct_of_peak_sustained_active"]),
    ("regs", ["launch__registers_per_thread"]),
    ("threads/block", ["launch__block_size"]),
    ("local ld req", ["l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum"]),
    ("local st req", ["l1tex__t_requests_pipe_lsu_mem_local_op_st.sum"]),
    ("smem/block B", ["launch__shared_mem_per_block"]),
    ("smem static B", ["launch__shared_mem_per_block_static"]),
    ("smem dyn B", ["launch__shared_mem_per_block_dynamic"]),
    ("blocks/SM (regs)", ["launch__occupancy_limit_registers"]),
    ("blocks/SM (smem)", ["launch__occupancy_limit_shared_mem"]),
    ("blocks/SM (warps)", ["launch__occupancy_limit_warps"]),
    ("theor. occ %", ["sm__maximum_warps_per_active_cycle_pct"]),
    ("achieved warps/SM", ["sm__warps_active.avg.per_cycle_active"]),
    ("st bank conflicts", ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"]),
    ("st wavefronts", ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"]),
    ("st instr", ["smsp__inst_executed_op_shared_st.sum", "sass__inst_executed_shared_stores"]),
    ("ld bank conflicts", ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"]),
    ("ld wavefronts", ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"]),
    ("instructions", ["smsp__inst_executed.sum", "sm__inst_executed.sum"]),
]
STALL = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def report(path: str, cases: list[str] | None = None) -> str:
    """A markdown table of the raw-page CSV at `path` (one row per profiled kernel)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r or "ID" in r)
    header, units, data = rows[start], rows[start + 1], rows[start + 2:]
    col = {name: i for i, name in enumerate(header)}
    lines = ["| case | " + " | ".join(c for c, _ in COLUMNS) + " | top stall reasons (warps per issue) |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for n, r in enumerate(data):
        if len(r) != len(header):
            continue
        cells = []
        for _, names in COLUMNS:
            val = next((r[col[m]] for m in names if m in col), "n/a")
            unit = next((units[col[m]] for m in names if m in col), "")
            x = _num(val)
            if x is not None and unit == "nsecond":
                x /= 1e3
            if x is not None and unit in ("byte/second", "Tbyte/second", "Gbyte/second", "Mbyte/second"):
                x *= {"byte/second": 1e-12, "Tbyte/second": 1.0, "Gbyte/second": 1e-3, "Mbyte/second": 1e-6}[unit]
            cells.append(val if x is None else f"{x:.4g}")
        stalls = []
        for name, i in col.items():
            if name.startswith(STALL) and name.endswith(STALL_SUFFIX) and "not_issued" not in name:
                x = _num(r[i])
                if x is not None:
                    stalls.append((x, name[len(STALL):-len(STALL_SUFFIX)]))
        top = ", ".join(f"{s} {x:.2f}" for x, s in sorted(stalls, reverse=True)[:5])
        label = cases[n] if cases and n < len(cases) else r[col.get("Kernel Name", 0)][:30]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import make_parser

    ap = make_parser(__doc__)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated DTYPE:VARIANT[@BxCTXxD]")
    ap.add_argument("--profile", action="store_true", help="run the cases under ncu and print the table")
    ap.add_argument("--launch", action="store_true", help="(internal) launch the cases; what ncu runs")
    ap.add_argument("--report", default=None, metavar="CSV",
                    help="print the table of a raw CSV (default: none; --profile makes one)")
    ap.add_argument("--out", default=None, metavar="DIR", help="folder for ncu_raw.csv and ncu.md (default: $OUT)")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    if args.launch:
        launch_cases(cases)
        return 0
    if args.report:
        print(report(args.report, cases))
        return 0
    if not args.profile:
        ap.error("give --profile (on the GPU machine) or --report CSV")
    from benchmarks.common import require_cuda

    require_cuda(ap)
    out_dir = args.out or os.environ.get("OUT", "/tmp")
    raw = os.path.join(out_dir, "ncu_raw.csv")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--set", "full", "--clock-control", "none", "-k", "regex:_decode_stage1",
           "--launch-skip", str(len(cases)), "--launch-count", str(len(cases)), "--csv", "--page", "raw",
           sys.executable, "-m", "benchmarks.ncu_decode", "--launch", "--cases", args.cases]
    res = subprocess.run(cmd, capture_output=True, text=True)
    text = res.stdout
    lines = [line for line in text.splitlines() if line.startswith('"')]  # the CSV, not ncu's ==PROF== notes
    if res.returncode != 0 or not lines or not lines[0].startswith('"ID"'):
        print(res.stdout[-3000:], res.stderr[-3000:], sep="\n")
        return 1
    with open(raw, "w") as f:
        f.write("\n".join(lines) + "\n")
    table = report(raw, cases)
    print(table)
    with open(os.path.join(out_dir, "ncu.md"), "w") as f:
        f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
