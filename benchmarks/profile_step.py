"""Where the time of one decode step goes (issue 5): host phases, GPU kernels, synchronization.

    python -m benchmarks.profile_step                # GPU: Llama-3.2-1B-shaped model, 256 sequences decoding
    python -m benchmarks.profile_step --shape 4b --batch 1   # GPU: the Qwen3-4B shape, one stream
    python -m benchmarks.profile_step --tiny         # CPU smoke run
    python -m benchmarks.profile_step --micro --stub-forward --batch 256 --extra async_scheduling=true
        # CPU: the forward pass returns a constant, so a step is the engine's host work alone
    python -m benchmarks.profile_step --prompt-tokens 512
        # GPU: every measured step also carries a new 512-token prompt (a mixed step, as served)
    python -m benchmarks.profile_step --pin-gpu-node
        # GPU: the host confined to the GPU's NUMA node (the same step has run at two speeds of the
        # host, 2.7 and 3.7 ms, with the same kernel time; the `host:` line says where each ran)

All requests are admitted and prefilled first; then --steps pure decode steps are measured:
1. wall time per step (the engine as it runs);
2. host time per phase (schedule / stage inputs / forward / sample+sync / bookkeeping), with
   the device synchronized at each boundary so GPU time lands in the phase that queued it;
3. torch.profiler's top kernels by device time over a few steps, and the device's busy time per
   step against the wall time: what the host left the GPU idle (async scheduling hides the host's
   work behind the device's; a host sync in the step shows here).

With --prompt-tokens N, a request of N prompt tokens (one output token) arrives before every step,
so each measured step is a mixed one: the decodes beside a whole new prompt.
"""

from __future__ import annotations

import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import DEVICE_HELP, default_device, host_facts, make_parser, pin_to_gpu_node
from benchmarks.throughput import MICRO, SHAPES, TINY, build_model
from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.messages import SampledToken
from pie.engine.sample.sampler import sample
from pie.engine.sample.tensors import SamplingTensors
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.step import StepOutput


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model (hidden 256, 4 layers) and batch")
    ap.add_argument("--micro", action="store_true", help="CPU: a model with next to nothing to compute")
    ap.add_argument("--unfreeze-gc", action="store_true", help="undo the engine's gc.freeze() (A/B)")
    ap.add_argument("--stub-forward", action="store_true",
                    help="the model's forward returns zeros at once: time the engine's host work alone")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES),
                    help="the model's shape without --tiny or --micro (benchmarks/throughput.py)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences decoding together (default: 256; 16 with --tiny or --micro)")
    ap.add_argument("--ctx", type=int, default=None,
                    help="prompt length of every sequence (default: 400; 32 with --tiny or --micro)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps per measured window")
    ap.add_argument("--kv", default="int8", help="KV cache dtype")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="a new prompt of this many tokens beside the decodes in every measured step (default: 0, "
                         "pure decode steps)")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="print the N functions with most Python time in step() (default: 0, no profile)")
    ap.add_argument("--pin-gpu-node", action="store_true",
                    help="run on the CPUs of the GPU's NUMA node only (is a slow host a far one?) (default: off)")
    ap.add_argument("--extra", default="",
                    help="EngineConfig overrides, k=v,k=v (ints/floats/bools) (default: none)")
    args = ap.parse_args(argv)
    args.device = args.device or default_device()
    big = not (args.tiny or args.micro)
    batch = args.batch or (256 if big else 16)
    ctx = args.ctx or (400 if big else 32)
    shape = SHAPES[args.shape] if big else MICRO if args.micro else TINY
    extra = {}
    for kv in filter(None, args.extra.split(",")):
        k, v = kv.split("=")
        extra[k] = {"true": True, "false": False}.get(v.lower(), None)
        if extra[k] is None:
            extra[k] = float(v) if "." in v else int(v)
    if args.pin_gpu_node:
        print(pin_to_gpu_node())
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), shape, torch.bfloat16 if args.device == "cuda" else torch.float32, made_by="pie")
        # a mixed step's new prompt (and, under async scheduling, the one before it, ending) ride beside the batch
        cfg = dict(model=tmp, device=args.device, dtype="bf16" if args.device == "cuda" else "fp32",
                   kv_cache_dtype=args.kv, max_num_seqs=batch + (2 if args.prompt_tokens else 0),
                   max_num_batched_tokens=max(8192, batch + args.prompt_tokens + 2),
                   kv_cache_memory_bytes=None if big else (128 << 20))
        cfg.update(extra)
        eng = EngineCore(EngineConfig(**cfg))
        if args.unfreeze_gc:
            gc.unfreeze()
        if args.stub_forward:
            # Random hidden states, drawn once: each row's logits then pick a token of the
            # vocabulary, as text does (zeros picked id 0 in every row, the bundled tokenizer's
            # <pad>, a skipped special that the detokenizer held back step after step).
            hidden = shape["hidden_size"]
            dtype = next(eng.model.parameters()).dtype
            noise = torch.randn(4096, hidden, generator=torch.Generator().manual_seed(0)).to(args.device, dtype)

            def stub(ids: torch.Tensor, pos: torch.Tensor, attn: object) -> torch.Tensor:
                return noise[pos % noise.shape[0]]

            eng.model.forward = stub
        rng = random.Random(0)
        sp = SamplingParams(max_tokens=eng.max_model_len - ctx, temperature=0, ignore_eos=True)
        requests = [eng.add_request(f"r{i}", [rng.randrange(3, shape["vocab_size"]) for _ in range(ctx)], sp).samples[0]
                    for i in range(batch)]
        while eng.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in requests):
            eng.step()
        arrivals = iter(range(10**9))
        one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

        def arrive() -> None:
            """With --prompt-tokens, a new prompt of that many tokens (one output token) arrives."""
            if args.prompt_tokens:
                eng.add_request(f"p{next(arrivals)}", [rng.randrange(3, shape["vocab_size"])
                                                       for _ in range(args.prompt_tokens)], one_token)

        def step():
            """One engine step, after an arrival (arrive)."""
            arrive()
            return eng.step()

        for _ in range(5):
            step()
        # Three windows of --steps steps: the first ones after prefill have been slower (up to 2x on
        # the H200, not explained yet), so each window is printed and the last one counts.
        # Beside each window's wall time: the share of it the stepping thread spent on a CPU
        # (below 1: it waited, for the device or for a CPU), and the garbage collections in it.
        windows, on_cpu, collections = [], [], []
        for _ in range(3):
            sync(args.device)
            gc_before = sum(g["collections"] for g in gc.get_stats())
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                step()
            sync(args.device)
            wall = time.perf_counter() - t0
            windows.append(1e3 * wall / args.steps)
            on_cpu.append((time.thread_time() - c0) / wall)
            collections.append(sum(g["collections"] for g in gc.get_stats()) - gc_before)
        step_ms = windows[-1]
        mixed = f", a new {args.prompt_tokens}-token prompt each step" if args.prompt_tokens else ""
        print(f"# {args.device}: batch {batch}, context ~{ctx}, kv {args.kv}{mixed}, {extra or ''}")
        print(f"wall per {'mixed' if args.prompt_tokens else 'decode'} step: {step_ms:.3f} ms  ({batch / step_ms * 1e3:,.0f} decode tok/s); "
              f"windows of {args.steps} steps: {', '.join(f'{w:.2f}' for w in windows)} ms")
        print(host_facts() + "; the stepping thread on a CPU " + ", ".join(f"{x:.0%}" for x in on_cpu)
              + " of each window, garbage collections " + ", ".join(map(str, collections)))
        if args.cprofile:  # Python time of the engine's own step, by function
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step()
            sync(args.device)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)

        # Phases, synchronized at each boundary.
        runner = eng.runner
        phases = dict(schedule=0.0, stage_inputs=0.0, forward=0.0, sample_and_sync=0.0, bookkeeping=0.0)
        orig_stage = runner.stager.stage
        marks: dict[str, float] = {}

        def timed_stage(*args_, **kwargs):
            t = time.perf_counter()
            r = orig_stage(*args_, **kwargs)
            sync(args.device)
            marks["stage_end"] = time.perf_counter()
            phases["stage_inputs"] += marks["stage_end"] - t
            return r

        runner.stager.stage = timed_stage
        graph_steps = 0
        for _ in range(args.steps):
            arrive()
            t = time.perf_counter()
            out = eng.scheduler.schedule()
            phases["schedule"] += time.perf_counter() - t
            graph_steps += runner.graphs.bucket_for(out) is not None
            with torch.inference_mode():
                rows, logits = runner.forward_logits(out)
                sync(args.device)
                t2 = time.perf_counter()
                phases["forward"] += t2 - marks["stage_end"]
                reqs = [out.scheduled[i].request for i in rows]
                tensors = SamplingTensors.build(
                    params=[r.sampling for r in reqs], seeds=[r.seed for r in reqs],
                    steps=[r.num_output_tokens for r in reqs], prompt_ids=[r.prompt_token_ids for r in reqs],
                    output_ids=[r.output_token_ids for r in reqs], vocab_size=logits.shape[-1], device=logits.device)
                ids = sample(logits, tensors).token_ids.tolist()
            t3 = time.perf_counter()
            phases["sample_and_sync"] += t3 - t2
            eng.scheduler.step_launched(out)
            eng.scheduler.update_from_output(StepOutput(reqs, [[SampledToken(tok, 0.0, [])] for tok in ids]))
            phases["bookkeeping"] += time.perf_counter() - t3
        runner.stager.stage = orig_stage
        print(f"{graph_steps}/{args.steps} steps replayed a CUDA graph")
        total = sum(phases.values())
        print("| phase (device synced at each boundary) | ms per step | share |")
        print("|---|---|---|")
        for k, v in phases.items():
            print(f"| {k} | {1e3 * v / args.steps:.3f} | {100 * v / total:.0f}% |")
        print(f"| total | {1e3 * total / args.steps:.3f} | |")

        if args.device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            for _ in range(3):  # out of the phases' synchronous steps, back to the engine's pace
                step()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                sync(args.device)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
            busy_ms = sum(e.self_device_time_total for e in prof.key_averages()
                          if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 / 5
            print(f"device busy per step: {busy_ms:.3f} ms (kernel time under the profiler) of {step_ms:.3f} ms "
                  f"wall (unprofiled): the GPU idle {max(0.0, 1 - busy_ms / step_ms):.0%} of the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
