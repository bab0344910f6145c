"""benchmarks/int8_roofline.py on the CPU interpreter: every stream kind and every build-up step
writes what its torch twin computes (fresh random ragged inputs, outputs poisoned first, split
counts that leave partial and empty splits), step 6 is the reference attention, the check catches
an output left unwritten or wrong, the sweep runs its phases, and `--tiny` runs end to end."""

from __future__ import annotations

import json
import random
import subprocess

import pytest
import torch

from benchmarks import int8_roofline as rl
from pie.kernels.reference import paged_attention_decode

DIMS = rl.TINY_DIMS
STREAM = rl.stream_specs(head_major=True)
BUILDUP = rl.buildup_specs(list(rl.KMODE))


def _inputs(rng: random.Random, **kw) -> rl.Inputs:
    """Three sequences: one of a single key or a few, one mid-length, one of several tiles."""
    lens = [rng.randint(1, 20), rng.randint(21, 70), rng.randint(71, 130)]
    rng.shuffle(lens)
    return rl.make_inputs(DIMS, lens, "cpu", torch.Generator().manual_seed(rng.randrange(2**63)), **kw)


def _launch(rng: random.Random, spec: rl.Spec) -> rl.Launch:
    rows = rng.choice([16, 2]) if spec.step >= 3 else 16
    return rl.Launch(rng.choice([16, 32]), 4, 2, rng.choice([2, 3, 5]), rows)


@pytest.mark.parametrize("spec", STREAM, ids=[s.key for s in STREAM])
def test_stream_kind_equals_torch(spec: rl.Spec, rng: random.Random) -> None:
    x = _inputs(rng, bf16=spec.pages == "bf16", head_major=spec.head_major)
    lc = _launch(rng, spec)
    assert rl.check(spec, x, lc) <= rl.tolerance(spec, "cpu"), lc


@pytest.mark.parametrize("spec", BUILDUP, ids=[s.key for s in BUILDUP])
def test_buildup_step_equals_torch(spec: rl.Spec, rng: random.Random) -> None:
    x = _inputs(rng)
    lc = _launch(rng, spec)
    assert rl.check(spec, x, lc) <= rl.tolerance(spec, "cpu"), lc


@pytest.mark.parametrize("kmode", list(rl.KMODE))
def test_step6_is_the_reference_attention(kmode: str, rng: random.Random) -> None:
    x = _inputs(rng)
    lc = rl.Launch(rng.choice([16, 32]), 4, 2, rng.choice([2, 3, 7]), rng.choice([16, 2]))
    o = rl.Outputs.make(x, lc.splits)
    o.poison()
    rl.launch(rl.Spec("t", 6, kmode=kmode), x, lc, o)
    ref = paged_attention_decode(x.q, x.k, x.v, x.ks, x.vs, x.table, x.lens, DIMS.d ** -0.5)
    assert torch.isfinite(o.out).all(), "an output left unwritten"
    # fp32 dots here; int8 tensor-core scores round q to two int8 terms per head
    assert ((o.out - ref).abs().max() / ref.abs().max()).item() < (1e-3 if kmode == "imma" else 1e-5), lc


@pytest.mark.parametrize("key", ["int8-raw", "bf16", "step1", "step2-bias-int", "step3-imma", "step4-bias",
                                 "step5-bias", "step6-cast"])
def test_the_check_catches_unwritten_and_wrong_outputs(key: str, rng: random.Random,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {s.key: s for s in STREAM + BUILDUP}[key]
    x = _inputs(rng, bf16=spec.pages == "bf16")
    lc = rl.Launch(16, 4, 2, 3, 16)
    real = rl.launch
    monkeypatch.setattr(rl, "launch", lambda *a, **k: None)  # writes nothing: the poison stays
    assert rl.check(spec, x, lc) == float("inf")

    def off_by_a_little(spec, x, lc, o, warmup=False):
        real(spec, x, lc, o)
        for t in (o.red_i, o.red_f, o.part, o.lse, o.out):
            t.view(-1)[0] += 1  # one entry of each output
    monkeypatch.setattr(rl, "launch", off_by_a_little)
    assert rl.check(spec, x, lc) > rl.tolerance(spec, "cpu")


def test_contiguous_reduction(rng: random.Random) -> None:
    gen = torch.Generator().manual_seed(rng.randrange(2**63))
    buf = torch.randint(-2**31, 2**31 - 1, (1 << 12,), dtype=torch.int32, generator=gen)
    out = torch.full((8,), 0x5A5A5A5A, dtype=torch.int32)
    rl._contig_kernel[(8,)](buf, out, 1 << 9, BLOCK=128)
    assert torch.equal(out, rl.contig_reference(1 << 9, buf))


def test_the_sweep_runs_its_phases() -> None:
    """Tile x splits at the base warps and stages, then warps x stages and rows at the best, then
    the splits again; points that do not apply are left out, failures kept as text."""
    space = rl.Space(tiles=(16, 32), splits=(2, 4, 8), warps=(2, 4), stages=(2, 3), base=(4, 3))

    def measure(lc: rl.Launch):
        if lc.tile == 32 and lc.splits == 8:
            return None
        if lc.warps == 2 and lc.stages == 2:
            raise RuntimeError("out of resources")
        return 1.0 + (lc.tile == 32) + 0.1 * lc.splits + (lc.warps == 4) - 0.5 * (lc.rows == 4)

    res = rl.sweep(measure, space, rl.Budget(60), rows=(16, 4))
    best, ms = rl.best_of(res)
    assert best == rl.Launch(16, 2, 3, 2, 4) and ms == pytest.approx(0.7)
    assert rl.Launch(32, 4, 3, 8) not in res  # not applicable
    assert isinstance(res[rl.Launch(16, 2, 2, 2)], str) and "out of resources" in res[rl.Launch(16, 2, 2, 2)]
    assert {lc for lc in res if lc.warps == 4 and lc.stages == 3 and lc.rows == 16} == {
        rl.Launch(t, 4, 3, s) for t in (16, 32) for s in (2, 4, 8) if (t, s) != (32, 8)}
    fixed = rl.sweep(measure, space, rl.Budget(60), fixed=rl.Launch(64, 2, 3, 1, 4))
    assert set(fixed) == {rl.Launch(t, 2, 3, s, 4) for t in (16, 32) for s in (2, 4, 8) if (t, s) != (32, 8)}
    assert rl.sweep(measure, space, rl.Budget(-1)) == {}  # over budget: nothing starts


def test_modes_refused_without_what_they_need(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as no_mode:
        rl.main([])
    assert no_mode.value.code == 2
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as asm:
        rl.main(["--asm"])
    assert asm.value.code == 2


def test_ncu_mode_reads_the_profile_into_a_table(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--ncu (GPU only) with ncu stood in for: the command profiles each case once after its
    compile launch, and the raw CSV becomes the table, a row per case named with its launch."""
    best = tmp_path / "best.json"
    best.write_text(json.dumps({"best": {"B64 ctx4096": {"step5-imma": vars(rl.Launch(16, 2, 3, 64, 4))}}}))
    header = ('"ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed",'
              '"launch__registers_per_thread","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"')
    rows = ['"","","nsecond","%","register/thread","ratio"', '"0","_roofline_kernel","150000","85.1","64","4.2"',
            '"1","_roofline_kernel","170000","75","128","3.5"', '"2","_decode_stage1","210000","62.5","128","2.5"']
    ran = []

    def fake_ncu(cmd, **kw):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "==PROF== profiling\n" + "\n".join([header, *rows]) + "\n", "")

    monkeypatch.setattr(rl.subprocess, "run", fake_ncu)
    parser_args = ["--ncu", "--ncu-cases", "int8-raw,step5-imma,shipped-int8", "--best", str(best), "--out", str(tmp_path)]
    monkeypatch.setattr(rl, "require_cuda", lambda ap: None)
    assert rl.main(parser_args) == 0
    (cmd,) = ran
    assert cmd[cmd.index("--launch-skip") + 1] == "3" and cmd[cmd.index("--launch-count") + 1] == "3"
    assert "--ncu-launch" in cmd and cmd[cmd.index("--best") + 1] == str(best)
    table = (tmp_path / "roofline_ncu.md").read_text()
    assert "| int8-raw @32 / 4 / 3 / 32 / 16 | 150 | 85.1 |" in table, table
    assert "| step5-imma @16 / 2 / 3 / 64 / 4 | 170 | 75 |" in table and "| shipped-int8 | 210 | 62.5 |" in table
    assert "long_scoreboard 4.20" in table


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path, rng: random.Random) -> None:
    assert rl.main(["--stream", "--buildup", "--tiny", "--out", str(tmp_path), "--seed", str(rng.randrange(2**20))]) == 0
    table = (tmp_path / "roofline.md").read_text()
    data = json.loads((tmp_path / "roofline.json").read_text())
    stream = [s.key for s in rl.stream_specs(False)]
    steps = [s.key for s in rl.buildup_specs(["bias", "imma"])]
    assert set(data["checks"]) == set(stream + steps) and "FAIL" not in table
    for key in stream + steps:
        assert data["checks"][key] <= rl.tolerance({s.key: s for s in STREAM + BUILDUP}[key], "cpu"), key
        assert f"| {key} | " in table
    assert set(data["stream"]) == set(stream) and all(data["stream"][k]["ms"] > 0 for k in stream)
    rows = data["buildup"]["B2 ctx64"]
    assert set(rows) == {"shipped-int8", "shipped-bf16", *steps} and all(rows[k]["ms"] > 0 for k in rows)
    for key in steps:  # the best launch of each row, as --ncu --best reads it
        assert rl.Launch(**data["best"]["B2 ctx64"][key]).tile in (16, 32)
    assert data["read_bw"] > 0 and data["copy_bw"] > 0
    # what ncu would profile, at the best launches of that run (one case at a launch of its own)
    cases = "int8-raw,step6-imma,step5-bias@16/4/2/3/2,shipped-int8,shipped-bf16"
    assert rl.main(["--ncu-launch", "--tiny", "--ncu-shape", "2x64", "--ncu-cases", cases,
                    "--best", str(tmp_path / "roofline.json")]) == 0
    assert rl.case_launch("step6-imma", data["best"], "B2 ctx64")[1] == rl.Launch(**data["best"]["B2 ctx64"]["step6-imma"])
    assert rl.case_launch("int8-raw", data["best"], "B64 ctx4096")[1] == rl.Launch(**data["best"]["stream"]["int8-raw"])
