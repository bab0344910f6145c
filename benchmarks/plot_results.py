"""Draws the README's benchmark figure from the numbers in benchmarks/RESULTS.md (never retyped).

    python benchmarks/plot_results.py [--out benchmarks/decode_bandwidth.png]

Decode attention at batch 64 on the H200: achieved bandwidth (TB/s, y) against log2(context
length) (x) for int8 pages (blue), bf16 pages (red), and the measured device copy bandwidth (green,
which drops to 0 at the right edge so the y axis starts at 0 TB/s; the grid has 4 bands).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import make_parser  # noqa: E402
from training.plot import plot_curves  # noqa: E402

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BATCH = 64


def decode_bandwidth(text: str, batch: int = BATCH) -> tuple[list[tuple[int, float, float]], float]:
    """[(ctx, int8 TB/s, bf16 TB/s)] of the decode table's rows at `batch`, and the copy TB/s."""
    section = text.split("### Decode", 1)[1].split("###", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[0].isdigit() and int(cells[0]) == batch:
            rows.append((int(cells[1]), float(cells[4]), float(cells[8])))
    copy = float(re.search(r"Copy bandwidth.*?\*\*([\d.]+) TB/s\*\*", text, re.S).group(1))
    if not rows:
        raise ValueError(f"no batch-{batch} rows in the decode table of {RESULTS}")
    return rows, copy


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--out", default=None,
                    help="PNG to write (default: benchmarks/decode_bandwidth.png, the README's figure)")
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
