"""benchmarks/schedule_sim.py: the engine's scheduler on a simulated clock ends every request,
gives every block back, and the stall bound shortens a burst's inter-token tail in it."""

from __future__ import annotations

from benchmarks.schedule_sim import CostModel, arrival_times, main, simulate
from benchmarks.serving import workload

COST = CostModel(6.2e-3, 4.9e-6, 22e-9, 1e-3, 25.5e-6)  # the script's defaults, in seconds


def run(factor: float, level: str) -> dict:
    work = workload("long", 48, 32000, prompt_len=0, max_tokens=0, scale=0.1)
    return simulate(work, arrival_times(level, 48, seed=5), COST, factor=factor, max_num_seqs=32,
                    max_batched_tokens=2048, num_blocks=4000)  # raises on a leaked block


def test_the_stall_bound_shortens_a_bursts_inter_token_tail() -> None:
    whole, bounded = run(0.0, "burst"), run(3.0, "burst")
    assert bounded["prompt_steps"] > whole["prompt_steps"]  # the prompts cut into more, smaller chunks
    assert bounded["itl_p99_ms"] < 0.8 * whole["itl_p99_ms"]
    assert bounded["itl_p99_ms"] <= 3.2 * bounded["itl_p50_ms"]
    assert bounded["tok_per_s"] > 0.9 * whole["tok_per_s"]


def test_poisson_arrivals_are_served_as_they_come() -> None:
    r = run(3.0, "40")
    assert r["ttft_p99_s"] < 0.1  # 40 req/s of ~110-token prompts: nothing queues for long


def test_smoke_run_prints_a_row_per_factor_and_level(capsys) -> None:
    assert main(["--tiny", "--factors", "0,3", "--rates", "burst,4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0 |") or line.startswith("| 3 |")]
    assert len(rows) == 4
