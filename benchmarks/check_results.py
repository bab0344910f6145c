"""Checks benchmarks/RESULTS.md, the table of current figures: every row whole and well formed.

    python -m benchmarks.check_results [--results PATH] [--commits]

RESULTS.md holds one table per area (a `## AREA` heading for each of AREAS), each with the
columns of HEADER, and a legend table (`| hardware | machine |`) naming the machines. A row is
whole when no cell is empty, its commit is 7-40 lowercase hex digits, its date a real day written
YYYY-MM-DD, its hardware a name from the legend and its command has a `backticked` command in it;
no metric appears twice. With --commits each commit must also be one of the repository's (an
ancestor of HEAD, so that a fresh clone holds it). Prints one line per problem and exits 1, or one
summary line and exits 0. benchmarks/plot_results.py reads the rows through `read_results`.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import make_parser

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HEADER = ("metric", "value", "spread", "commit", "hardware", "command", "date")
LEGEND = ("hardware", "machine")
AREAS = ("Kernels", "Engine offline", "Serving", "CPU", "Fidelity", "Reliability", "Training")
COMMIT = re.compile(r"[0-9a-f]{7,40}")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass(frozen=True, slots=True)
class Row:
    """One current figure: the cells of a results row, its area and its line (1-based)."""

    area: str
    line: int
    metric: str
    value: str
    spread: str
    commit: str
    hardware: str
    command: str
    date: str


@dataclass(slots=True)
class Results:
    rows: list[Row]
    hardware: dict[str, str]  # legend: name -> machine
    areas: list[str]  # the `## ` headings, in order
    problems: list[str]  # what could not be read as a row or a table


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def read_results(text: str) -> Results:
    """The rows of every results table and the hardware legend; lines that look like table rows
    but belong to no known table, or rows of the wrong width, land in `problems`."""
    out = Results([], {}, [], [])
    area = ""
    table: tuple[str, ...] | None = None  # the header of the table being read
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            area, table = line[3:].strip(), None
            out.areas.append(area)
            continue
        if not line.startswith("|"):
            table = None
            continue
        cells = _cells(line)
        if table is None:  # a header line
            table = tuple(cells)
            if table not in (HEADER, LEGEND):
                out.problems.append(f"line {n}: a table whose header is neither {HEADER} nor {LEGEND}")
            continue
        if all(set(c) <= set("-: ") and c for c in cells):  # the separator under the header
            continue
        if len(cells) != len(table):
            out.problems.append(f"line {n}: {len(cells)} cells where the table has {len(table)} "
                                "(a missing cell, or a '|' inside one)")
            continue
        if table == LEGEND:
            out.hardware[cells[0]] = cells[1]
        elif table == HEADER:
            if not area:
                out.problems.append(f"line {n}: a results row before the first `## AREA` heading")
            out.rows.append(Row(area, n, *cells))
    return out


def problems(results: Results) -> list[str]:
    """What is wrong with the rows and the areas (empty when all is well)."""
    found = list(results.problems)
    missing = [a for a in AREAS if a not in results.areas]
    extra = [a for a in results.areas if a not in AREAS]
    if missing:
        found.append(f"areas missing: {', '.join(missing)}")
    if extra:
        found.append(f"unknown areas (one of {', '.join(AREAS)}): {', '.join(extra)}")
    seen: dict[str, int] = {}
    for row in results.rows:
        where = f"line {row.line} ({row.metric[:40]!r})"
        empty = [name for name in HEADER if not getattr(row, name)]
        if empty:
            found.append(f"{where}: empty {', '.join(empty)}")
        if row.commit and not COMMIT.fullmatch(row.commit):
            found.append(f"{where}: commit {row.commit!r} is not 7-40 lowercase hex digits")
        if row.date:
            try:
                if not DATE.fullmatch(row.date):
                    raise ValueError
                datetime.date.fromisoformat(row.date)
            except ValueError:
                found.append(f"{where}: date {row.date!r} is not a day written YYYY-MM-DD")
        if row.hardware and row.hardware not in results.hardware:
            found.append(f"{where}: hardware {row.hardware!r} is not in the legend ({', '.join(results.hardware)})")
        if row.command and not re.search(r"`[^`]+`", row.command):
            found.append(f"{where}: the command is not written `like this`")
        if row.metric in seen:
            found.append(f"{where}: the metric is also on line {seen[row.metric]}")
        seen.setdefault(row.metric, row.line)
    if not results.rows:
        found.append("no results rows")
    return found


def unknown_commits(rows: list[Row], repo: Path = ROOT) -> list[str]:
    """The rows whose commit is not an ancestor of the repository's HEAD."""
    found = []
    for commit in sorted({r.commit for r in rows if COMMIT.fullmatch(r.commit)}):
        ok = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", commit, "HEAD"],
                            capture_output=True).returncode == 0
        if not ok:
            lines = ", ".join(str(r.line) for r in rows if r.commit == commit)
            found.append(f"commit {commit} (lines {lines}) is not in this repository's history")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--results", default=None,
                    help="the results file to check (default: this checkout's benchmarks/RESULTS.md)")
    ap.add_argument("--commits", action="store_true",
                    help="also check that every commit is in the history of the repository's HEAD (needs git "
                         "and a clone that is not shallow)")
    args = ap.parse_args(argv)
    args.results = args.results or str(RESULTS)
    results = read_results(Path(args.results).read_text())
    found = problems(results)
    if args.commits:
        found += unknown_commits(results.rows)
    for line in found:
        print(f"{args.results}: {line}", file=sys.stderr)
    if found:
        return 1
    print(f"{args.results}: {len(results.rows)} figures in {len(AREAS)} areas, every row whole")
    return 0


if __name__ == "__main__":
    sys.exit(main())
