"""A burst step by step (issue 29): serving.py's long work, every request queued at once on a fresh
engine (no gRPC), once per --decode-stall-factor and --decode-stall-share, --rounds times on each engine
(the prompts drawn anew each round; the stall budget learns the streams' output lengths from a
finished round, so a cold engine's first round runs the plain bound). Per round: tokens/s, time to first token and
inter-token latency (token times as `step()` returns them), how many steps carried prompt tokens
and how many each, and what the stall bound learnt (engine/scheduling/stall.py `StallBound`: what carrying
any prompt adds to a step, what a prompt token adds, the decode model's context term and its
measured ratio). --out keeps every step: its decodes, prompt tokens and the time the engine
measured for it.

    python benchmarks/burst_steps.py                   # GPU: Llama-3.1-8B shape, factors 2 and 3
    python benchmarks/burst_steps.py --factors 0,3 --shares 0,0.005 --rounds 2   # the stall budget's worth
    python benchmarks/burst_steps.py --tiny            # CPU smoke run (tiny model, small work)

The served burst (serving.py --burst) is the same work through gRPC; this shows why it behaves as
it does, one step at a time. Its requests are streamed, as the served burst's: the stall bound
protects only decodes whose caller reads them as they come.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser  # noqa: E402
from benchmarks.mixed import SHAPES, build_model  # noqa: E402
from benchmarks.serving import for_level, workload  # noqa: E402
from pie.engine.config import EngineConfig  # noqa: E402
from pie.engine.core.engine_core import EngineCore  # noqa: E402
from pie.engine.sampling_params import SamplingParams  # noqa: E402


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


def run_burst(eng: EngineCore, prompts: list[list[int]], outs: list[int], tag: str) -> dict:
    """The work queued at once on `eng`, stepped to the end: the figures and every step."""
    stall = eng.scheduler.stall
    stalled_before = eng.scheduler.stall_budget.stall_steps
    steps: list[dict] = []
    schedule, observe = eng.scheduler.schedule, stall.observe

    def recording_schedule():
        out = schedule()
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        steps.append(dict(decodes=decodes, prompt_tokens=out.num_batched_tokens - decodes))
        return out

    def recording_observe(num_decodes, num_prompt_tokens, seconds, kv_tokens=0):
        measured.append(dict(decodes=num_decodes, prompt_tokens=num_prompt_tokens, seconds=seconds,
                             kv_tokens=kv_tokens))
        observe(num_decodes, num_prompt_tokens, seconds, kv_tokens)

    measured: list[dict] = []
    eng.scheduler.schedule, stall.observe = recording_schedule, recording_observe
    token_times: dict[str, list[float]] = {}
    try:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, outs)):
            eng.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                            streamed=True)  # as the served burst's streams
        generated = 0
        while eng.has_unfinished():
            outputs = eng.step()
            now = time.perf_counter() - t0
            for o in outputs:
                if o.new_token_ids:
                    token_times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
                    generated += len(o.new_token_ids)
        wall = time.perf_counter() - t0
    finally:
        del eng.scheduler.schedule, stall.observe
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    ttft = [times[0] for times in token_times.values()]
    prompt_steps = [s for s in steps if s["prompt_tokens"]]
    return dict(
        tok_per_s=generated / wall, wall_s=wall,
        ttft_p50_s=percentile(ttft, 0.5), ttft_p99_s=percentile(ttft, 0.99),
        itl_p50_ms=1e3 * percentile(itl, 0.5), itl_p90_ms=1e3 * percentile(itl, 0.9),
        itl_p99_ms=1e3 * percentile(itl, 0.99),
        steps=len(steps), prompt_steps=len(prompt_steps),
        prompt_tokens_per_step=statistics.mean(s["prompt_tokens"] for s in prompt_steps) if prompt_steps else 0.0,
        unbounded_steps=stall.unbounded_steps, stalled_steps=eng.scheduler.stall_budget.stall_steps - stalled_before,
        fixed_ms=1e3 * stall.fixed_s, per_prompt_token_us=1e6 * (stall.per_prompt_token_s or 0.0),
        kv_token_ns=1e9 * stall.kv_token_s, decode_ratio=stall.decode_ratio,
        trace=dict(scheduled=steps, measured=measured))


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny shape, small work")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    sized = SizedFlags(ap)
    sized.add("--shape", "llama-8b", "tiny", "model shape (benchmarks/mixed.py)", type=str, choices=sorted(SHAPES))
    sized.add("--requests", 256, 12, "requests, all queued at once")
    sized.add("--scale", 1.0, 0.05, "multiplies every length of the long work (serving.py --scale)", type=float)
    sized.add("--max-num-seqs", 256, 16, "running sequences per step at most")
    sized.add("--max-batched-tokens", 8192, 256, "tokens per step at most")
    ap.add_argument("--factors", default="2,3", help="--decode-stall-factor values, one fresh engine each")
    ap.add_argument("--shares", default=None,
                    help="--decode-stall-share values, one fresh engine each with every factor above 0 (default: "
                         "the engine's default alone)")
    ap.add_argument("--rounds", type=int, default=1, help="bursts run on each engine, one after another")
    ap.add_argument("--kv", default="int8", help="KV cache dtype")
    ap.add_argument("--out", default=None, help="JSON file for the figures and every step (default: none written)")
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    args.device = args.device or default_device()
    arch, shape = SHAPES[args.shape]
    work = workload("long", args.requests, shape["vocab_size"], prompt_len=64, max_tokens=128, scale=args.scale)
    on_gpu = args.device == "cuda"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), arch, shape, torch.bfloat16 if on_gpu else torch.float32,
                    max_len=max(map(len, work.prompts)) + max(work.max_tokens) + 16)
        print(f"# {args.device}: {args.shape} shape, {args.requests} requests queued at once, "
              f"{sum(map(len, work.prompts)):,} prompt tokens, {sum(work.max_tokens):,} out; {args.kv} pages")
        print("| factor | share | round | tok/s | TTFT p50 / p99 s | ITL p50 / p90 / p99 ms (p99/p50) | "
              "prompt steps (tokens each) | stalled steps | t_fixed ms | µs a prompt token | ns a context token | "
              "decode ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        default_share = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "decode_stall_share")
        shares = [float(x) for x in args.shares.split(",") if x] if args.shares else [default_share]
        for factor in [float(f) for f in args.factors.split(",") if f]:
            for share in shares if factor else [0.0]:
                eng = EngineCore(EngineConfig(model=tmp, device=args.device, dtype="bf16" if on_gpu else "fp32",
                                             kv_cache_dtype=args.kv, max_num_seqs=args.max_num_seqs,
                                             max_num_batched_tokens=args.max_batched_tokens, decode_stall_factor=factor,
                                             decode_stall_share=share))
                for n in range(args.rounds):
                    level = for_level(work, n, shape["vocab_size"])
                    key = f"{factor:g}" if args.rounds == 1 and not args.shares else f"{factor:g}/{share:g}/{n + 1}"
                    r = results[key] = run_burst(eng, level.prompts, level.max_tokens, f"f{factor:g}-s{share:g}-r{n}")
                    print(f"| {factor:g} | {share:g} | {n + 1} | {r['tok_per_s']:,.0f} | "
                          f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                          f"{r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} / {r['itl_p99_ms']:.1f} "
                          f"({r['itl_p99_ms'] / r['itl_p50_ms']:.1f}) | {r['prompt_steps']} "
                          f"({r['prompt_tokens_per_step']:,.0f}) | {r['stalled_steps']} | "
                          f"{r['fixed_ms']:.1f} | {r['per_prompt_token_us']:.1f} | {r['kv_token_ns']:.1f} | "
                          f"{r['decode_ratio']:.2f} |", flush=True)
                del eng
                gc.unfreeze()
                gc.collect()
                if on_gpu:
                    torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
