"""Draws the benchmark figure of docs/performance.md from the numbers in benchmarks/RESULTS.md (never retyped).

    python -m benchmarks.plot_results [--out benchmarks/decode_bandwidth.png]

Decode attention at batch 64 on the H200: achieved bandwidth (TB/s, y) against log2(context
length) (x) for int8 pages (blue), bf16 pages (red), and the measured device copy bandwidth (green,
which drops to 0 at the right edge so the y axis starts at 0 TB/s; the grid has 4 bands). The
figures are RESULTS.md's "decode sweep" rows (read by benchmarks/check_results.py's parser).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from benchmarks.check_results import RESULTS, read_results
from benchmarks.common import make_parser
from pie.training.plot import plot_curves

ROOT = Path(__file__).resolve().parent.parent

BATCH = 64
SWEEP = re.compile(r"decode sweep B(\d+) ctx(\d+) D128, (int8|bf16) pages, do_bench")
TBS = re.compile(r"([\d.]+) TB/s")


def decode_bandwidth(text: str, batch: int = BATCH) -> tuple[list[tuple[int, float, float]], float]:
    """[(ctx, int8 TB/s, bf16 TB/s)] of the decode sweep's rows at `batch`, by context, and the
    copy TB/s of the same run."""
    found: dict[int, dict[str, float]] = {}
    copy = None
    for row in read_results(text).rows:
        m = SWEEP.fullmatch(row.metric)
        if m and int(m.group(1)) == batch:
            tbs = TBS.search(row.value)
            if tbs is None:
                raise ValueError(f"line {row.line}: no TB/s in {row.value!r}")
            found.setdefault(int(m.group(2)), {})[m.group(3)] = float(tbs.group(1))
        elif row.metric.startswith("decode sweep copy bandwidth") and (tbs := TBS.search(row.value)):
            copy = float(tbs.group(1))
    for ctx, pages in found.items():
        for kind in {"int8", "bf16"} - pages.keys():
            raise ValueError(f"the decode sweep at batch {batch} ctx {ctx} lacks {kind} pages in {RESULTS}")
    rows = [(ctx, v["int8"], v["bf16"]) for ctx, v in sorted(found.items())]
    if not rows or copy is None:
        raise ValueError(f"no batch-{batch} decode sweep rows (int8 and bf16) or no copy bandwidth in {RESULTS}")
    return rows, copy


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--out", default=None,
                    help="PNG to write (default: benchmarks/decode_bandwidth.png, docs/performance.md's figure)")
    args = ap.parse_args(argv)
    args.out = args.out or str(ROOT / "benchmarks" / "decode_bandwidth.png")
    rows, copy = decode_bandwidth(RESULTS.read_text())
    xs = [ctx.bit_length() - 1 for ctx, _, _ in rows]
    plot_curves(args.out, [list(zip(xs, (r[1] for r in rows))), list(zip(xs, (r[2] for r in rows))),
                           [(xs[0], copy), (xs[-1], copy), (xs[-1], 0.0)]], width=480, height=300)
    sys.stdout.write(f"{args.out}: batch {BATCH}, ctx {[r[0] for r in rows]}, int8 {[r[1] for r in rows]} TB/s, "
                     f"bf16 {[r[2] for r in rows]} TB/s, copy {copy} TB/s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
