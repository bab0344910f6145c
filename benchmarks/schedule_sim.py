"""The scheduler on a simulated clock (issue 29): the engine's own `Scheduler` and `BlockManager`,
each step timed by a cost model instead of run on a GPU, so what a scheduling rule does to
throughput, time to first token and inter-token latency under a burst or Poisson arrivals shows
in seconds on a CPU, before a GPU run measures it.

    python benchmarks/schedule_sim.py                        # the long work: burst, 4 and 8 req/s
    python benchmarks/schedule_sim.py --factors 0,2,3 --rates 16 --jitter 0.2
    python benchmarks/schedule_sim.py --tiny                 # a smoke run (CI)

The cost model (flags): a decode-only step of d rows over K tokens of context takes base + row x
d + kv x K seconds; a step that carries P prompt tokens takes that (base alone without decodes)
plus fixed + token x P. The defaults are the Llama-3.1-8B shape's on the H200 (RESULTS.md,
int8 pages): base and row from its decode steps of 32 rows over ~1,800 tokens each (7.70 ms) and
of 256 over one token (7.5 ms), kv from its graphs timed over long contexts, fixed and token
from the line mixed_step.py fits beside 32 decodes and burst_steps.py's slope. Each
step then stretched by a uniform draw in [0, --jitter). The stall bound learns from these times as
it learns from the engine's, and starts from the prior CUDA graphs give it (the decode model at
one-token contexts, by batch bucket). Every request emits a token at the end of each step that
samples it; TTFT counts from its arrival, ITL between its tokens.

What it leaves out, so its figures rank rules rather than predict the engine's: the host, async
scheduling (a step launched before the last one's tokens are read), the GEMMs turning
compute-bound beside many decode rows (on the H200 the first ~500 prompt tokens beside 256 decodes
cost ~12 ms more than the line, beside 32 decodes ~1 ms), attention's growth with a chunk's
position in its prompt. On 2026-12-03 it ranked the bound against the rows decoding so far below
the bound against the batch being built, as the H200 then did (HISTORY.md); its own figures were
not the GPU's.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import SizedFlags, make_parser  # noqa: E402
from benchmarks.serving import Work, for_level, workload  # noqa: E402
from pie.engine.messages import SampledToken  # noqa: E402
from pie.engine.sampling_params import SamplingParams  # noqa: E402
from pie.engine.scheduling.block_manager import BlockManager  # noqa: E402
from pie.engine.scheduling.request import Request  # noqa: E402
from pie.engine.scheduling.scheduler import Scheduler  # noqa: E402
from pie.engine.scheduling.step import StepOutput  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)  # decode graph batch sizes


class CostModel:
    def __init__(self, base: float, row: float, kv: float, fixed: float, token: float) -> None:
        self.base, self.row, self.kv, self.fixed, self.token = base, row, kv, fixed, token

    def decode(self, rows: int, context: int) -> float:
        return self.base + self.row * rows + self.kv * context

    def step(self, rows: int, context: int, prompt_tokens: int) -> float:
        t = self.decode(rows, context) if rows else self.base
        return t + (self.fixed + self.token * prompt_tokens if prompt_tokens else 0.0)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


def scheduler(work: Work, cost: CostModel, *, factor: float, share: float, max_num_seqs: int,
              max_batched_tokens: int, num_blocks: int) -> Scheduler:
    """A scheduler for `work`, its stall bound primed as CUDA graphs prime the engine's."""
    max_len = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens, strict=True))
    bm = BlockManager(num_blocks, 16, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens,
                      max_model_len=max_len, stall_factor=factor, stall_share=share)
    sched.stall.prior = {b: cost.decode(b, 0) for b in BUCKETS if b <= max_num_seqs}
    sched.stall.kv_token_s = cost.kv
    return sched


def simulate(sched: Scheduler, work: Work, arrivals: list[float], cost: CostModel, *, jitter: float = 0.0,
             seed: int = 0, tag: str = "r") -> dict:
    """The work arriving at `arrivals` (seconds), scheduled step by step until every request ends;
    its figures. Raises if a request never finishes or a block is not given back."""
    rng = random.Random(seed)
    bm, max_len = sched.block_manager, sched.max_model_len
    requests = [Request(f"{tag}{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True), max_model_len=max_len,
                        arrival_time=t, streamed=True)  # served streams: the stall bound protects them
                for i, (prompt, n, t) in enumerate(zip(work.prompts, work.max_tokens, arrivals, strict=True))]
    token_times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    now, arrived, prompt_steps, prompt_tokens = 0.0, 0, 0, 0
    while arrived < len(requests) or sched.has_unfinished():
        while arrived < len(requests) and requests[arrived].arrival_time <= now:
            sched.add_request(requests[arrived].group)
            arrived += 1
        if not sched.has_unfinished():
            now = requests[arrived].arrival_time  # idle until the next arrival
            continue
        out = sched.schedule()
        decodes = [s for s in out.scheduled if s.start >= len(s.request.prompt_token_ids)]
        rows, context = len(decodes), sum(s.start + 1 for s in decodes)
        prompt = out.num_batched_tokens - rows
        seconds = cost.step(rows, context, prompt) * (1.0 + jitter * rng.random())
        now += seconds
        prompt_steps += prompt > 0
        prompt_tokens += prompt
        sched.step_launched(out)
        sampled = out.sampling_requests
        sched.update_from_output(StepOutput(sampled, [[SampledToken(7, 0.0, [])] for _ in sampled]))
        for r in sampled:
            token_times[r.request_id].append(now)
        sched.stall.observe(rows, prompt, seconds, context)
    if bm.num_free_blocks != bm.num_total_blocks:
        raise RuntimeError(f"{bm.num_total_blocks - bm.num_free_blocks} KV blocks never given back")
    ttft = [token_times[r.request_id][0] - r.arrival_time for r in requests]
    itl = [b - a for ts in token_times.values() for a, b in zip(ts, ts[1:])]
    return dict(tok_per_s=sum(len(ts) for ts in token_times.values()) / now, ttft_p50_s=percentile(ttft, 0.5),
                ttft_p99_s=percentile(ttft, 0.99), itl_p50_ms=1e3 * percentile(itl, 0.5),
                itl_p99_ms=1e3 * percentile(itl, 0.99), prompt_steps=prompt_steps,
                prompt_tokens_per_step=prompt_tokens / max(prompt_steps, 1))


def arrival_times(level: str, n: int, seed: int) -> list[float]:
    """Every request at 0 (burst), or Poisson arrivals at `level` requests/s."""
    if level == "burst":
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(float(level))
        times.append(t)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="a smoke run: few requests, short lengths")
    sized = SizedFlags(ap)
    sized.add("--requests", 256, 24, "requests per level")
    sized.add("--scale", 1.0, 0.1, "multiplies every length of the work (serving.py --scale)", type=float)
    ap.add_argument("--workload", choices=("chat", "mixed", "long"), default="long",
                    help="serving.py's workloads (chat: prompts median 256, outputs up to 512)")
    ap.add_argument("--rates", default="burst,4,8", help="levels: burst and/or Poisson rates in requests/s")
    ap.add_argument("--factors", default="0,3", help="--decode-stall-factor values, one fresh scheduler each")
    ap.add_argument("--shares", default="0", help="--decode-stall-share values, one fresh scheduler each")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the work run this many times on one scheduler, its prompts drawn anew each round "
                         "(the stall budget learns the streams' output lengths from a round); a row per round")
    sized.add("--max-num-seqs", 256, 16, "running sequences at most")
    sized.add("--max-batched-tokens", 8192, 256, "tokens per step at most")
    ap.add_argument("--blocks", type=int, default=200_000, help="KV blocks of 16 tokens in the pool")
    ap.add_argument("--base-ms", type=float, default=6.2, help="a decode step's fixed part, ms")
    ap.add_argument("--row-us", type=float, default=4.9, help="what a decode row adds, µs")
    ap.add_argument("--kv-ns", type=float, default=22.0, help="what a token of the decodes' context adds, ns")
    ap.add_argument("--fixed-ms", type=float, default=1.0, help="what carrying any prompt tokens adds, ms")
    ap.add_argument("--token-us", type=float, default=25.5, help="what a prompt token adds, µs")
    ap.add_argument("--jitter", type=float, default=0.1, help="each step stretched by a uniform share in [0, this)")
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    cost = CostModel(args.base_ms * 1e-3, args.row_us * 1e-6, args.kv_ns * 1e-9, args.fixed_ms * 1e-3,
                     args.token_us * 1e-6)
    work = workload(args.workload, args.requests, 32000, prompt_len=256, max_tokens=512, scale=args.scale)
    print(f"# simulated: {args.workload} work x {args.scale:g}, {args.requests} requests, "
          f"{sum(map(len, work.prompts)):,} prompt tokens, {sum(work.max_tokens):,} out")
    print("| factor | share | level | round | tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms (p99/p50) | "
          "prompt steps (tokens each) | stall steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for factor in [float(f) for f in args.factors.split(",") if f]:
        for share in [float(f) for f in args.shares.split(",") if f]:
            for level in [x for x in args.rates.split(",") if x]:
                sched = scheduler(work, cost, factor=factor, share=share, max_num_seqs=args.max_num_seqs,
                                  max_batched_tokens=args.max_batched_tokens, num_blocks=args.blocks)
                for n in range(args.rounds):
                    stalls = sched.stall_budget.stall_steps
                    r = simulate(sched, for_level(work, n, 32000), arrival_times(level, args.requests, seed=5), cost, jitter=args.jitter,
                                 seed=n, tag=f"round{n}-")
                    ratio = r["itl_p99_ms"] / r["itl_p50_ms"] if r["itl_p50_ms"] else float("nan")
                    print(f"| {factor:g} | {share:g} | {level} | {n + 1} | {r['tok_per_s']:,.0f} | "
                          f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                          f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} ({ratio:.1f}) | "
                          f"{r['prompt_steps']} ({r['prompt_tokens_per_step']:,.0f}) | "
                          f"{sched.stall_budget.stall_steps - stalls} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
