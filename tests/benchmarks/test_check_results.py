"""benchmarks/RESULTS.md holds whole rows (benchmarks/check_results.py), its commits are in this
repository's history, and the checker finds each kind of broken row; docs/performance.md's figure is drawn
from its decode sweep rows (benchmarks/plot_results.py)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from benchmarks import check_results, plot_results
from benchmarks.check_results import AREAS, HEADER, problems, read_results, unknown_commits

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "benchmarks" / "RESULTS.md").read_text()
# a row of the real file to break in each case below
ROW = next(line for line in TEXT.splitlines() if line.startswith("| decode B64 ctx4096 D128, int8 pages, graph |"))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _with_row(cells: list[str]) -> str:
    return TEXT.replace(ROW, "| " + " | ".join(cells) + " |")


def _changed(column: str, value: str) -> str:
    cells = _cells(ROW)
    cells[HEADER.index(column)] = value
    return _with_row(cells)


def test_the_results_file_is_whole() -> None:
    results = read_results(TEXT)
    assert problems(results) == []
    assert [a for a in results.areas if a in AREAS] == list(AREAS)
    assert {row.area for row in results.rows} == set(AREAS)  # no area left empty
    assert {row.hardware for row in results.rows} == set(results.hardware)  # no machine named for nothing


def test_every_commit_is_in_the_history() -> None:
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                         text=True)
    if git.returncode != 0 or git.stdout.strip() != "false":
        pytest.skip("needs a git clone with its whole history")
    rows = read_results(TEXT).rows
    assert unknown_commits(rows) == []
    assert unknown_commits([dataclasses.replace(rows[0], commit="0000000")]) != []


@pytest.mark.parametrize("column, value, says", [
    ("spread", "", "empty spread"),
    ("commit", "", "empty commit"),
    ("commit", "7229F70", "is not 7-40 lowercase hex digits"),
    ("commit", "72290", "is not 7-40 lowercase hex digits"),
    ("commit", "HEAD", "is not 7-40 lowercase hex digits"),
    ("date", "2026-12-32", "is not a day written YYYY-MM-DD"),
    ("date", "2026-12-2", "is not a day written YYYY-MM-DD"),
    ("date", "2 December 2026", "is not a day written YYYY-MM-DD"),
    ("hardware", "A100", "is not in the legend"),
    ("command", "attention.py", "is not written `like this`"),
    ("metric", "decode B256 ctx4096 D128, int8 pages, graph", "the metric is also on line"),
])
def test_a_broken_field_is_found(column, value, says) -> None:
    found = problems(read_results(_changed(column, value)))
    assert len(found) == 1 and says in found[0], found
    assert f"line {TEXT.splitlines().index(ROW) + 1}" in found[0]  # the broken row's, or named as the first


def test_a_missing_cell_or_a_pipe_inside_one_is_found() -> None:
    cells = _cells(ROW)
    for broken in (cells[:-1], cells[:2] + ["a | b"] + cells[3:]):
        found = problems(read_results(_with_row(broken)))
        assert len(found) == 1 and "cells where the table has 7" in found[0], found


def test_a_missing_area_or_a_foreign_table_is_found() -> None:
    found = problems(read_results(TEXT.replace("## Training\n", "## Training runs\n")))
    assert "areas missing: Training" in found and any("unknown areas" in f for f in found)
    foreign = TEXT.replace("| metric | value | spread | commit | hardware | command | date |",
                           "| metric | value | spread | hardware | command | date |", 1)
    assert any("a table whose header is neither" in f for f in problems(read_results(foreign)))


def test_the_command_line_exits_1_on_a_broken_file_and_0_on_ours(tmp_path, capsys) -> None:
    broken = tmp_path / "RESULTS.md"
    broken.write_text(_changed("date", "yesterday"))
    assert check_results.main(["--results", str(broken)]) == 1
    assert "date 'yesterday'" in capsys.readouterr().err
    assert check_results.main([]) == 0
    assert "every row whole" in capsys.readouterr().out


def test_the_readme_figure_reads_the_decode_sweep_rows() -> None:
    rows, copy = plot_results.decode_bandwidth(TEXT)
    assert [ctx for ctx, _, _ in rows] == [512, 4096, 32768]
    assert all(0 < int8 < bf16 <= 1.1 * copy for _, int8, bf16 in rows)
    sweep = next(line for line in TEXT.splitlines() if line.startswith("| decode sweep B64 ctx4096 D128, bf16 pages"))
    with pytest.raises(ValueError, match="ctx 4096 lacks bf16"):
        plot_results.decode_bandwidth(TEXT.replace(sweep + "\n", ""))
