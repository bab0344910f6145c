"""Scheduler-depth benchmark (issue 6): prefix caching and chunked prefill, measured on the engine.

    python benchmarks/scheduling.py                      # GPU shapes (random Llama, hidden 2048)
    python benchmarks/scheduling.py --tiny               # CPU-sized: smaller model and workload

1. Shared system prompt: `--requests` requests of a `--prefix`-token shared prefix + `--unique`
   unique tokens, `--max-tokens` generated each, all submitted at once; TTFT (submit -> first
   token) p50/p99, total time and generated tokens/s, with prefix caching off and on.
2. Long prompts arriving mid-stream: `--streams` requests decoding, then `--long` prompts of
   `--long-len` tokens arrive; the running streams' inter-token gap (max and p99 over the window
   where the long prompts prefill), with chunked prefill (token budget `--chunk`) and without
   (a budget that takes each long prompt in one step).

The model is random-initialized (weights do not matter for scheduling) and exported once to a
temporary Hugging Face-layout folder with the bundled tokenizer.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser  # noqa: E402
from pie.engine.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from pie.engine.core.engine_core import EngineCore  # noqa: E402
from pie.engine.sampling_params import SamplingParams  # noqa: E402
from pie.model.config import ModelConfig  # noqa: E402
from pie.model.llama import LlamaForCausalLM  # noqa: E402
from pie.training.export import export_hf  # noqa: E402


def make_model(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, max_len: int) -> str:
    vocab = ModelConfig.from_hf(DEFAULT_MODEL).vocab_size  # the bundled tokenizer's ids
    cfg = ModelConfig.from_hf(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_len, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2))
    model = LlamaForCausalLM(cfg)
    model.init_weights()
    export_hf(model, cfg, DEFAULT_MODEL, folder)
    return str(folder)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")


def shared_prefix(model: str, args, caching: bool) -> dict:
    eng = EngineCore(EngineConfig(model=model, device=args.device, kv_cache_dtype="int8",
                                 kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.budget, enable_prefix_caching=caching))
    rng = random.Random(0)
    prefix = [rng.randrange(3, 2000) for _ in range(args.prefix)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    eng.generate([prefix[:8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i in range(args.requests):
        eng.add_request(f"q{i}", prefix + [rng.randrange(3, 2000) for _ in range(args.unique)], sp)
    tokens = 0
    while eng.has_unfinished():
        for o in eng.step():
            tokens += len(o.new_token_ids)
            first.setdefault(o.request_id, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    st = eng.stats()
    ttft = list(first.values())
    return dict(caching=caching, ttft_p50_ms=1e3 * pct(ttft, 50), ttft_p99_ms=1e3 * pct(ttft, 99), wall_s=wall,
                tok_per_s=tokens / wall, hit_rate=st.prefix_cache_hits / max(1, st.prefix_cache_queries))


def long_prompts(model: str, args, budget: int) -> dict:
    eng = EngineCore(EngineConfig(model=model, device=args.device, kv_cache_dtype="int8",
                                 kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=budget, enable_prefix_caching=False))
    rng = random.Random(1)
    sp = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    streams = [f"s{i}" for i in range(args.streams)]
    for rid in streams:
        eng.add_request(rid, [rng.randrange(3, 2000) for _ in range(32)], SamplingParams(
            max_tokens=args.long_len, temperature=0, ignore_eos=True))
    for _ in range(5):
        eng.step()  # all streams decoding
    last = {rid: time.perf_counter() for rid in streams}
    gaps: list[float] = []
    for j in range(args.long):
        eng.add_request(f"long{j}", [rng.randrange(3, 2000) for _ in range(args.long_len)],
                        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    pending = {f"long{j}" for j in range(args.long)}
    while pending:
        for o in eng.step():
            now = time.perf_counter()
            if o.request_id in last and o.new_token_ids:
                gaps.append(now - last[o.request_id])
                last[o.request_id] = now
            if o.finished:
                pending.discard(o.request_id)
    for rid in streams:
        eng.abort(rid)
    del sp
    return dict(budget=budget, gap_p50_ms=1e3 * statistics.median(gaps), gap_p99_ms=1e3 * pct(gaps, 99),
                gap_max_ms=1e3 * max(gaps))


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and workload")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    sized = SizedFlags(ap)
    sized.add("--requests", 256, 32, "shared-prefix part: requests, all submitted at once")
    sized.add("--prefix", 1000, 200, "shared-prefix part: tokens of the prefix every request starts with")
    sized.add("--unique", 100, 20, "shared-prefix part: tokens of each request after the prefix")
    sized.add("--max-tokens", 64, 16, "shared-prefix part: tokens generated per request")
    sized.add("--streams", 32, 8, "long-prompt part: requests decoding while the long prompts arrive")
    sized.add("--long", 4, 2, "long-prompt part: long prompts arriving")
    sized.add("--long-len", 16384, 400, "long-prompt part: tokens per long prompt")
    sized.add("--chunk", 2048, 64, "long-prompt part: the token budget per step with chunked prefill")
    sized.add("--max-num-seqs", 256, 64, "running sequences per step at most")
    sized.add("--budget", 8192, 512, "shared-prefix part: tokens per step at most")
    sized.add("--kv-bytes", 40 << 30, 256 << 20, "KV pool in bytes", shown=("40 GiB", "256 MiB"))
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    args.device = args.device or default_device()
    big = not args.tiny
    shape = (2048, 16, 32, 8, 8192) if big else (256, 4, 8, 4, 768)
    max_len = max(args.prefix + args.unique + args.max_tokens, args.long_len + 64)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp), *shape, max_len=max_len)
        print(f"# {args.device}: random Llama hidden {shape[0]}, {shape[1]} layers; int8 KV cache")
        print(f"\n## shared prefix: {args.requests} requests x ({args.prefix} shared + {args.unique} unique) tokens, "
              f"{args.max_tokens} generated")
        print("| prefix caching | TTFT p50 ms | TTFT p99 ms | total s | tokens/s | prompt tokens from cache |")
        print("|---|---|---|---|---|---|")
        for caching in (False, True):
            r = shared_prefix(model, args, caching)
            print(f"| {'on' if caching else 'off'} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                  f"{r['wall_s']:.2f} | {r['tok_per_s']:,.0f} | {100 * r['hit_rate']:.0f}% |")
        print(f"\n## {args.streams} decoding streams while {args.long} prompts of {args.long_len} tokens arrive")
        print("| token budget per step | stream gap p50 ms | p99 ms | max ms |")
        print("|---|---|---|---|")
        for budget in (args.chunk, args.long_len + args.streams):
            r = long_prompts(model, args, budget)
            label = f"{budget} (chunked)" if budget == args.chunk else f"{budget} (whole prompt per step)"
            print(f"| {label} | {r['gap_p50_ms']:.1f} | {r['gap_p99_ms']:.1f} | {r['gap_max_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
