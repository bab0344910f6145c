"""benchmarks/schedule_sim.py: the engine's scheduler on a simulated clock ends every request,
gives every block back, the stall bound shortens a burst's inter-token tail in it, and the stall
budget buys back tokens/s without giving the tail back."""

from __future__ import annotations

from benchmarks.schedule_sim import CostModel, arrival_times, main, scheduler, simulate
from benchmarks.serving import for_level, workload

COST = CostModel(6.2e-3, 4.9e-6, 22e-9, 1e-3, 25.5e-6)  # the script's defaults, in seconds


WORK = workload("long", 48, 32000, prompt_len=0, max_tokens=0, scale=0.1)


def run(factor: float, level: str, share: float = 0.0, rounds: int = 1) -> dict:
    """The last of `rounds` rounds on one scheduler, each with its prompts drawn anew."""
    sched = scheduler(WORK, COST, factor=factor, share=share, max_num_seqs=32, max_batched_tokens=2048,
                      num_blocks=4000)
    for n in range(rounds):
        r = simulate(sched, for_level(WORK, n, 32000), arrival_times(level, 48, seed=5), COST, seed=n,
                     tag=f"round{n}-")  # raises on a leaked block
    return r


def test_the_stall_bound_shortens_a_bursts_inter_token_tail() -> None:
    whole, bounded = run(0.0, "burst"), run(3.0, "burst")
    assert bounded["prompt_steps"] > whole["prompt_steps"]  # the prompts cut into more, smaller chunks
    assert bounded["itl_p99_ms"] < 0.8 * whole["itl_p99_ms"]
    assert bounded["itl_p99_ms"] <= 3.2 * bounded["itl_p50_ms"]
    assert bounded["tok_per_s"] > 0.9 * whole["tok_per_s"]


def test_the_stall_budget_buys_back_a_bursts_tokens_per_second() -> None:
    """A round on a cold scheduler has no output lengths to go on and keeps the plain bound; the
    next, with the budget, admits the burst in fewer steps, closer to whole budgets' tokens/s,
    and its inter-token p99 stays a bounded gap."""
    whole, bounded = run(0.0, "burst", rounds=2), run(3.0, "burst", rounds=2)
    cold, budget = run(3.0, "burst", share=0.005), run(3.0, "burst", share=0.005, rounds=2)
    assert cold["prompt_steps"] == bounded["prompt_steps"] and cold["tok_per_s"] == bounded["tok_per_s"]
    assert budget["prompt_steps"] < bounded["prompt_steps"]
    assert budget["tok_per_s"] > bounded["tok_per_s"]
    assert budget["itl_p99_ms"] < 0.8 * whole["itl_p99_ms"]
    assert budget["itl_p99_ms"] <= 3.2 * budget["itl_p50_ms"]


def test_poisson_arrivals_are_served_as_they_come() -> None:
    r = run(3.0, "40")
    assert r["ttft_p99_s"] < 0.1  # 40 req/s of ~110-token prompts: nothing queues for long


def test_smoke_run_prints_a_row_per_factor_and_level(capsys) -> None:
    assert main(["--tiny", "--factors", "0,3", "--shares", "0,0.005", "--rates", "burst,4", "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0 |") or line.startswith("| 3 |")]
    assert len(rows) == 2 * 2 * 2 * 2  # factors x shares x levels x rounds
