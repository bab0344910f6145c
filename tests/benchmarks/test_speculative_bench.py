"""benchmarks/speculative.py --quick, in this process on the CPU: every part writes its figures
to the JSON and its table to stdout; the oracle proposals are accepted as many as asked and the
outputs stay plain decoding's; the n-gram proposer's runs are plain decoding's too (fp32 weights,
where a verify step computes the same logits as a decode step), and copying prompts get
proposals accepted."""

from __future__ import annotations

import json

import pytest

from benchmarks import speculative


@pytest.mark.slow
def test_quick_run_of_all_three_parts(tmp_path, capsys) -> None:
    out = tmp_path / "spec.json"
    assert speculative.main(["--quick", "--dtype", "fp32", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["shape"] == "micro" and data["skipped"] == []

    # (a): K = 0..2 at batch 1 and 3, each against its K = 0 row
    cost = data["cost"]
    assert [(r["batch"], r["k"]) for r in cost] == [(b, k) for b in (1, 3) for k in range(3)]
    for r in cost:
        assert len(r["step_ms_all"]) == 3 and min(r["step_ms_all"]) <= r["step_ms"] <= max(r["step_ms_all"])
        assert r["step_ms"] > 0 and r["launch_ms"] > 0
        assert r["step_x_k0"] == pytest.approx(r["step_ms"] / next(
            c["step_ms"] for c in cost if c["batch"] == r["batch"] and c["k"] == 0))
    assert "| 3 | 2 |" in stdout

    # (b): plain, then a = 0..K forced; past the default speculative_max_batch (8) also the default
    speed = data["speed"]
    assert [(r["batch"], r["speculation"], r["k"], r["accepted"]) for r in speed] == [
        (1, "off", 0, 0), (1, "forced", 2, 0), (1, "forced", 2, 1), (1, "forced", 2, 2),
        (12, "off", 0, 0), (12, "default (max batch 8)", 2, 2),
        (12, "forced", 2, 0), (12, "forced", 2, 1), (12, "forced", 2, 2)]
    for r in speed:
        assert r["requests"] == 3 * r["batch"] and r["tok_per_s"] > 0 and len(r["tok_per_s_all"]) == 3, r
        # plain runs repeat the reference run; forced verdicts emit the proposals (not compared)
        assert r["identical"] == (r["requests"] if r["speculation"] == "off" else None), r
        if r["speculation"] == "forced":
            # exactly a accepted per verify step, but where max_tokens left fewer to propose
            assert r["accepted"] - 0.2 <= r["accepted_per_step"] <= r["accepted"], r
        elif r["speculation"] == "off":
            assert r["speedup"] == 1.0 and r["accepted_per_step"] is None
        else:
            assert r["accepted_per_step"] is None  # 12 decodes > 8: nobody speculated
    assert [(c["k"], c["accepted"], sorted(c["speedup_by_batch"])) for c in data["crossover"]] == [
        (2, a, ["1", "12"]) for a in range(3)]
    assert "| 12 | default (max batch 8) |" in stdout and "forced, K=2, a=2:" in stdout

    # (c): three kinds of prompt, greedy and sampled; every run plain decoding's
    ngram = data["ngram"]
    assert [(r["kind"], r["temperature"]) for r in ngram] == [
        (kind, t) for kind in ("repeat", "edit", "corpus") for t in (0.0, 0.8)]
    for r in ngram:
        assert r["identical"] == r["runs"] == 3, r
        assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["mean_accepted_length"] <= 5
        assert r["ngram_tok_per_s"] > 0 and r["plain_tok_per_s"] > 0 and len(r["plain_tok_per_s_all"]) == 3
    assert data["ngram_mismatches"] == []
    repeat = ngram[0]
    assert repeat["acceptance_rate"] > 0 and repeat["mean_accepted_length"] > 1 and repeat["tokens_per_step"] > 1
    assert data["meta"]["ngram_dtype"] == "fp32" and data["meta"]["ngram_words_edited"] > 0
    assert "| repeat | 0 |" in stdout and "| corpus | 0.8 |" in stdout
