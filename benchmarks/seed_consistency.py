"""One answer per seed, measured where the tests cannot hold it bit for bit: the same seeded
requests run cold, again with their prefix cached, chunked (a 64-token step budget), and alone or
in batches of other requests (--batch-sizes); per KV cache dtype, the share of requests whose
tokens equal the cold run's, and the first token where each one parted.

On the CPU the logits of a token agree within float rounding (tests/engine/sample/test_seed_consistency.py).
On a GPU the matrix products pick kernels by the number of rows in a step, and decode and extend
attention are different kernels: a step of another shape rounds differently, and a token whose two
best choices are that close may go either way. This says how often, on a random model.

    python -m benchmarks.seed_consistency [--shape llama-1b] [--requests 32] [--tokens 64] [--batch-invariant]
    python -m benchmarks.seed_consistency --tiny
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser
from benchmarks.mixed import SHAPES, build_model
from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in got:
                got[o.request_id].extend(o.new_token_ids)
    return got


def parted(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and counts")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    sized = SizedFlags(ap)
    sized.add("--shape", "llama-1b", "tiny", "model shape (benchmarks/mixed.py)", type=str, choices=sorted(SHAPES))
    sized.add("--requests", 32, 6, "seeded requests compared")
    sized.add("--tokens", 64, 16, "tokens generated per request")
    sized.add("--prompt-len", 300, 40, "prompt tokens per request (a few full blocks and a tail)")
    ap.add_argument("--batch-sizes", default="1,8,64", help="batch sizes a request runs in (others fill the batch)")
    ap.add_argument("--kv", default="int8,bf16", help="KV cache dtypes, comma-separated")
    ap.add_argument("--greedy", action="store_true", help="greedy instead of temperature 1")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine's batch-invariant mode (EngineConfig.batch_invariant; CUDA)")
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    args.device = args.device or default_device()
    arch, shape = SHAPES[args.shape]
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompts = {f"q{i}": [rng.randrange(3, vocab) for _ in range(args.prompt_len + i % 16)] for i in range(args.requests)}
    sps = {rid: SamplingParams(max_tokens=args.tokens, temperature=0.0 if args.greedy else 1.0, seed=1000 + i,
                               ignore_eos=True) for i, rid in enumerate(prompts)}
    requests = {rid: (prompts[rid], sps[rid]) for rid in prompts}
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    print(f"# {args.shape}, {args.device}, batch-invariant mode {'on' if args.batch_invariant else 'off'}")
    print("| KV cache | compared with cold | requests with the same tokens | first parting (token index) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), arch, shape, torch.bfloat16 if args.device == "cuda" else torch.float32,
                    max_len=args.prompt_len + args.tokens + 64)
        for kv in args.kv.split(","):
            def engine(**kw) -> EngineCore:
                cfg = dict(model=tmp, device=args.device, kv_cache_dtype=kv, max_num_seqs=max(64, max(sizes)),
                           max_num_batched_tokens=8192, kv_cache_memory_bytes=2 << 30,
                           batch_invariant=args.batch_invariant)
                return EngineCore(EngineConfig(**{**cfg, **kw}))

            eng = engine(enable_prefix_caching=True)
            cold = run(eng, requests)
            others = {"cached": run(eng, requests)}
            others["chunked (64-token steps)"] = run(engine(max_num_batched_tokens=64, enable_prefix_caching=False),
                                                     requests)
            lone = engine(enable_prefix_caching=False)
            for size in sizes:
                got: dict[str, list[int]] = {}
                for rid, req in requests.items():
                    filler = {f"f{j}-{rid}": ([rng.randrange(3, vocab) for _ in range(args.prompt_len)],
                                              SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=j,
                                                             ignore_eos=True)) for j in range(size - 1)}
                    got[rid] = run(lone, {rid: req, **filler})[rid]
                others[f"in a batch of {size}"] = got
            for what, got in others.items():
                parts = [p for rid in requests if (p := parted(cold[rid], got[rid])) is not None]
                same = len(requests) - len(parts)
                where = ", ".join(map(str, sorted(parts)[:8])) + (" ..." if len(parts) > 8 else "") or "-"
                print(f"| {kv} | {what} | {same}/{len(requests)} | {where} |", flush=True)
            del eng, lone
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
