"""Realistic work offline: log-normal prompt lengths, a shared prefix, varied output lengths, on a
random model; the engine with int8 and bf16 pages in one run, each repeated, the median reported
with the spread.

    python -m benchmarks.mixed [--shape qwen3-4b|llama-1b] [--requests 384] [--repeats 3]
    python -m benchmarks.mixed --workload long [--kv-gib ample,8]   # long-context work, two pools
    python -m benchmarks.mixed --tiny [--workload long]            # CPU-sized smoke run of the same code
    python -m benchmarks.mixed --workload chat [--tiny]            # multi-turn chat, KV tiers off/host/disk

Workloads (--workload; fixed seed, greedy, EOS ignored, all requests queued at once): prompt lengths
log-normal with median --prompt-median (sigma 0.8), clipped to [16, --prompt-max]; every
--prefix-every-th prompt starts with one shared --prefix-len-token prefix; output lengths uniform in
[--out-min, --out-max]. Their defaults:
  mixed  issue 16's work on the Qwen3-4B shape: 384 requests, prompts median 250 (up to 2,000), a
         quarter after one 400-token prefix, outputs 32-400
  long   the long-context work on an 8B-class shape (Llama-3.1-8B's dimensions): 256 requests,
         prompts median 800 (up to 6,000), a third after one 1,500-token prefix, outputs 128-1,024,
         first with memory ample, then with the KV pool fixed at 8 GiB (--kv-gib ample,8)
Each pool in --kv-gib is a pass of its own (every KV dtype, --repeats times); int8 pages read half
the K/V bytes, so their ideal (below) is lower (1.17x at the long work on an H200).

Beside the achieved time: an ideal time from the work itself, (a) prefill FLOPs (2 x params x
prompt tokens not served from the prefix cache, plus causal attention) at --tflops, and (b) for
each decode step actually run, the weights once plus every scheduled sequence's K/V once at the
copy bandwidth measured in the same run (bytes / copy bandwidth). Where the time went: steps that
carried prompt tokens, full decode steps (at least half of --max-num-seqs rows), the low-batch
tail, and host time outside steps.

Optional parts, in the same run on the same model:
  --serve 64,256   the same requests through `pie serve` (int8) over gRPC, closed loop at each
                   concurrency: tokens/s, TTFT and inter-token latency p50/p99
  --hf 128         transformers `generate_batch` on the first N requests x 256 tokens, and the
                   engine (int8) on the same subset
  --single         one user: decode tokens/s (128-token prompt, 512 out) and the TTFT of a
                   2,000-token prompt, against the weight-bandwidth bound (weights / copy bw)
--no-prefix-caching runs the same work without the prefix cache: what the shared prefix saves.

--workload chat (issue 62, the host and disk tiers below the KV pool): --conversations chats of
--turns turns each after one shared --system-len-token system prompt; each turn re-sends its whole
history (system, earlier turns and the replies the engine gave) plus --user-len new tokens and is
answered with --reply-len tokens. Turns arrive interleaved, round-robin over the conversations, with
--in-flight turns at once (a conversation's next turn only after its reply), so a conversation's
prefix waits for the others' turns between two of its own. The pool holds --pool-share (a quarter)
of the working set (the system prompt and every conversation's final history), the host tier
--host-gib (default: 1.1x the working set in int8 pages; bf16 pages get the same GiB), the disk
tier the whole working set. Per KV dtype and tier setting (off, host, host+disk), --repeats runs
on a fresh engine (a fresh disk folder): TTFT p50/p99 (arrival to first token), generated tokens/s,
the prompt tokens served from the pool, the host and the disk, a read-back's mean time from lookup
to joining the pool (on CUDA: to the schedule that publishes it, about a step), and how many blocks
were handed out while their copy down was still in flight (each makes a step or a read-back wait).

Then, per KV dtype (with a host tier), what a read-back costs the steps it overlaps, measured apart
from the chat's own steps (whose times mix in the prefill of the turns admitted with a read-back):
--in-flight rows decoding, alone and with a read-back of a conversation's whole history issued
before every step (the tiers' own copy of host rows into free pool blocks, which the next step waits
for, as a published read-back's does), in alternated rounds: the median step time of each.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser
from benchmarks.throughput import copy_bandwidth, sync
from pie.engine.config import DEFAULT_MODEL, EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.runner.kv_cache import KVCache
from pie.engine.sampling_params import SamplingParams

SHAPES = {
    # Qwen3-4B: head dim 128, GQA 4:1, q/k norms, tied embeddings.
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                               vocab_size=151936, tie_word_embeddings=True)),
    # Llama-3.1-8B: head dim 128, GQA 4:1, untied embeddings, 128k vocabulary.
    "llama-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                               tie_word_embeddings=False)),
    "llama-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, intermediate_size=8192, vocab_size=32000,
                               tie_word_embeddings=True)),
    # Qwen2-7B: head dim 128, GQA 7:1 (4 KV heads), q/k/v biases, untied embeddings.
    "qwen2-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                               tie_word_embeddings=False)),
    "tiny": ("qwen3", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, intermediate_size=512, vocab_size=4096, tie_word_embeddings=True)),
}


def build_model(folder: Path, arch: str, shape: dict, dtype: torch.dtype, max_len: int = 4096) -> int:
    """A random-initialized model saved by transformers, with the bundled tokenizer; returns its
    parameter count. `max_len`: its context length."""
    import shutil

    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    cfg = cls(**shape, max_position_embeddings=max_len, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initializing 4B weights on a CPU takes minutes
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL) / name, folder / name)
    return sum(p.numel() for p in model.parameters())


def workload(n: int, vocab: int, prompt_median: int, prompt_max: int, prefix_len: int,
             out_range: tuple[int, int], seed: int = 0, prefix_every: int = 4) -> tuple[list[list[int]], list[int]]:
    """Prompts of log-normal length (sigma 0.8) clipped to [16, prompt_max], every
    `prefix_every`-th one after a shared prefix; output lengths uniform in out_range."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts, outs = [], []
    for i in range(n):
        length = min(prompt_max, max(16, round(rng.lognormvariate(math.log(prompt_median), 0.8))))
        body = [rng.randrange(3, vocab) for _ in range(length)]
        prompts.append(prefix + body if i % prefix_every == 0 else body)
        outs.append(rng.randint(*out_range))
    return prompts, outs


class Timeline:
    """Wraps an engine's schedule() and step(): per step, its wall time and what it carried."""

    def __init__(self, eng: EngineCore) -> None:
        self.steps: list[dict] = []
        self._schedule, self._step = eng.scheduler.schedule, eng.step
        self._last: dict = {}
        eng.scheduler.schedule, eng.step = self._counting_schedule, self._timed_step
        self.eng = eng

    def _counting_schedule(self):
        out = self._schedule()
        decode_rows = [s for s in out.scheduled if s.num_new_tokens == 1 and s.start >= s.request.num_prompt_tokens]
        self._last = dict(prompt_tokens=out.num_batched_tokens - len(decode_rows), rows=len(out.scheduled),
                          kv_tokens=sum(s.start + s.num_new_tokens for s in out.scheduled))
        return out

    def _timed_step(self):
        self._last = dict(prompt_tokens=0, rows=0, kv_tokens=0)
        t = time.perf_counter()
        outs = self._step()
        self.steps.append(dict(seconds=time.perf_counter() - t, **self._last))
        return outs

    def detach(self) -> None:
        del self.eng.scheduler.schedule, self.eng.step


def ideal_seconds(steps: list[dict], params: int, layers: int, q_size: int, kv_bytes_per_token: int,
                  prompt_tokens_computed: int, attn_flops: float, copy_bw: float, tflops: float,
                  weight_bytes: int) -> float:
    prefill = (2 * params * prompt_tokens_computed + attn_flops) / (tflops * 1e12)
    decode = sum((weight_bytes + s["kv_tokens"] * kv_bytes_per_token) / copy_bw
                 for s in steps if s["prompt_tokens"] == 0 and s["rows"] > 0)
    return prefill + decode


def single_user(eng: EngineCore, vocab: int, device: str, repeats: int = 3) -> dict:
    """One request alone: decode tokens/s of a 128-token prompt generating 512 (from its first
    token to its last), and the time to the first token of a 2,000-token prompt; medians."""
    rng = random.Random(7)

    def one(prompt_len: int, n: int) -> tuple[float, float]:
        rid = f"single-{rng.getrandbits(32)}"
        eng.add_request(rid, [rng.randrange(3, vocab) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        sync(device)
        t0 = time.perf_counter()
        first = None
        while eng.has_unfinished():
            if eng.step() and first is None:
                first = time.perf_counter()
        return first - t0, time.perf_counter() - first

    decode = statistics.median((512 - 1) / one(128, 512)[1] for _ in range(repeats))
    long_prompt = min(2000, eng.max_model_len - 2)
    ttft = statistics.median(one(long_prompt, 1)[0] for _ in range(repeats))
    return dict(decode_tok_per_s=decode, ttft_2k_ms=1e3 * ttft, ttft_prompt_tokens=long_prompt)


def run_engine(folder: Path, kv: str, prompts, outs, args, extra: bool = False) -> dict:
    """The workload --repeats times on a fresh engine; with `extra`, also the --single and --hf
    subset measurements on the same engine."""
    eng = EngineCore(EngineConfig(model=str(folder), device=args.device,
                                 dtype="bf16" if args.device == "cuda" else "fp32", kv_cache_dtype=kv,
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                 decode_stall_factor=getattr(args, "decode_stall_factor", 0.0),
                                 enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
                                 kv_cache_memory_bytes=None if args.kv_gib is None else int(args.kv_gib * 2**30)))
    eng.generate([p[:32] for p in prompts[:4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    more = {}
    if extra and args.single:
        more["single"] = single_user(eng, eng.model_config.vocab_size, args.device)
    if extra and args.hf:
        subset = prompts[:args.hf]
        eng.block_manager.reset_prefix_cache()
        sync(args.device)
        t0 = time.perf_counter()
        got = eng.generate(subset, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
        sync(args.device)
        more["hf_subset_tok_per_s"] = sum(map(len, got)) / (time.perf_counter() - t0)
    timeline = Timeline(eng)
    runs = []
    for _ in range(args.repeats):
        eng.block_manager.reset_prefix_cache()
        hits_before = eng.stats().prefix_cache_hits
        timeline.steps.clear()
        ids = [f"m{i}-{len(runs)}" for i in range(len(prompts))]
        sync(args.device)
        t0 = time.perf_counter()
        for rid, p, n in zip(ids, prompts, outs):
            eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        generated = 0
        while eng.has_unfinished():
            for o in eng.step():
                generated += len(o.new_token_ids)
        sync(args.device)
        wall = time.perf_counter() - t0
        runs.append(dict(wall_s=wall, tokens=generated, tok_per_s=generated / wall, steps=list(timeline.steps),
                         cached_prompt_tokens=eng.stats().prefix_cache_hits - hits_before))
    timeline.detach()
    kv_per_token = KVCache.bytes_per_block(num_layers=eng.model_config.num_hidden_layers, block_size=1,
                                           num_kv_heads=eng.model_config.num_key_value_heads,
                                           head_dim=eng.model_config.head_dim, kv_cache_dtype=kv)
    info = dict(kv_blocks=eng.block_manager.num_total_blocks, kv_per_token=kv_per_token,
                mc=eng.model_config, **more)
    del eng
    gc.unfreeze()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return dict(runs=runs, **info)


def run_hf(folder: Path, prompts, device: str) -> float:
    """transformers' continuous batching (generate_batch, paged|sdpa) on `prompts` x 256 tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="paged|sdpa").to(device)
    gen = GenerationConfig(max_new_tokens=256, do_sample=False, eos_token_id=None, pad_token_id=0, use_cuda_graph=False)
    model.generate_batch(inputs=[p[:32] for p in prompts[:4]], generation_config=gen)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen)
    sync(device)
    tok_per_s = sum(len(r.generated_tokens) for r in out.values()) / (time.perf_counter() - t0)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return tok_per_s


def serve(folder: Path, prompts, outs, args) -> list[dict]:
    """The workload through `pie serve` (int8, the engine in its own process), closed loop at each
    concurrency in --serve."""
    import asyncio

    from benchmarks.serving import one_request, start_server, summarize
    from pie_client import AsyncClient

    extra = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_batched_tokens),
             "--max-waiting", str(4 * len(prompts)), "--device", args.device]
    if args.kv_gib is not None:
        extra += ["--kv-cache-memory", str(args.kv_gib)]
    proc, address = start_server(str(folder), extra)
    rows = []
    arch, shape = SHAPES[args.shape]
    try:
        for level in [int(x) for x in args.serve.split(",") if x]:
            # A fresh draw of the workload per level (same distribution): the server's prefix cache
            # still holds the previous level's prompts, which would skip their prefill.
            prompts, outs = workload(len(prompts), shape["vocab_size"], args.prompt_median, args.prompt_max,
                                     args.prefix_len, (args.out_min, args.out_max), seed=level,
                                     prefix_every=args.prefix_every)

            async def run() -> dict:
                async with AsyncClient(address, timeout=900) as client:
                    order = list(range(len(prompts)))
                    stats: list = []

                    async def worker():
                        while order:
                            i = order.pop(0)
                            stats.append(await one_request(client, prompts[i], outs[i], temperature=0.0))

                    t0 = time.perf_counter()
                    await asyncio.gather(*(worker() for _ in range(level)))
                    return summarize("closed", level, stats, time.perf_counter() - t0)
            rows.append(asyncio.run(run()))
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def report(results: dict, prompts: list[list[int]], params: int, weight_bytes: int, copy_bw: float, tflops: float,
           max_num_seqs: int, label: str = "") -> dict:
    """Prints the table (tokens/s with its spread, the wall and ideal times of the median run, the
    share of the ideal reached) and where each dtype's time went; returns the figures by dtype."""
    print(f"| KV cache{label} | tokens/s (median) | spread | wall s | ideal s | achieved / ideal |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for kv, r in results.items():
        mc = r["mc"]
        rates = sorted(x["tok_per_s"] for x in r["runs"])
        med = statistics.median(rates)
        run = min(r["runs"], key=lambda x: abs(x["tok_per_s"] - med))
        computed = sum(map(len, prompts)) - run["cached_prompt_tokens"]
        attn = sum(4 * len(p) ** 2 / 2 * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers for p in prompts)
        ideal = ideal_seconds(run["steps"], params, mc.num_hidden_layers, mc.q_size, r["kv_per_token"], computed,
                              attn, copy_bw, tflops, weight_bytes)
        print(f"| {kv} | {med:,.0f} | {rates[0]:,.0f}-{rates[-1]:,.0f} | {run['wall_s']:.2f} | {ideal:.2f} | "
              f"{100 * ideal / run['wall_s']:.0f}% |")
        summary[kv] = dict(tok_per_s_median=med, tok_per_s_all=rates, wall_s=run["wall_s"], ideal_s=ideal,
                           breakdown=breakdown(run["steps"], run["wall_s"], max_num_seqs // 2),
                           kv_blocks=r["kv_blocks"])
    for kv, s in summary.items():
        print(f"{kv}: {s['breakdown']}")
    if "int8" in summary and "bf16" in summary:
        print(f"int8 / bf16 tokens/s (medians): "
              f"{summary['int8']['tok_per_s_median'] / summary['bf16']['tok_per_s_median']:.2f}x")
    return summary


def breakdown(steps: list[dict], wall: float, full_rows: int) -> str:
    prefill = [s for s in steps if s["prompt_tokens"] > 0]
    full = [s for s in steps if s["prompt_tokens"] == 0 and s["rows"] >= full_rows]
    tail = [s for s in steps if s["prompt_tokens"] == 0 and 0 < s["rows"] < full_rows]
    inside = sum(s["seconds"] for s in steps)
    return (f"prefill-carrying steps {len(prefill)}: {sum(s['seconds'] for s in prefill):.2f} s; "
            f"full decode steps (>= {full_rows} rows) {len(full)}: {sum(s['seconds'] for s in full):.2f} s; "
            f"low-batch tail {len(tail)}: {sum(s['seconds'] for s in tail):.2f} s; "
            f"host outside steps {wall - inside:.2f} s")


# Per workload: flag -> (help, type, (full default, --tiny default)).
PRESETS = {
    "mixed": dict(shape=("qwen3-4b", "tiny"), requests=(384, 24), prompt_median=(250, 40), prompt_max=(2000, 200),
                  prefix_len=(400, 48), prefix_every=(4, 4), out_min=(32, 4), out_max=(400, 24),
                  kv_gib=("ample", "0.1")),
    "long": dict(shape=("llama-8b", "tiny"), requests=(256, 12), prompt_median=(800, 60), prompt_max=(6000, 300),
                 prefix_len=(1500, 96), prefix_every=(3, 3), out_min=(128, 8), out_max=(1024, 32),
                 kv_gib=("ample,8", "ample,0.05")),
}
FLAGS = {"shape": ("model shape", str), "requests": ("requests, all queued at once", int),
         "prompt_median": ("median prompt length in tokens (log-normal, sigma 0.8)", int),
         "prompt_max": ("longest prompt in tokens (longer draws are clipped)", int),
         "prefix_len": ("tokens of the shared prefix", int),
         "prefix_every": ("every N-th prompt starts with the shared prefix", int),
         "out_min": ("fewest tokens generated per request", int), "out_max": ("most tokens generated per request", int),
         "kv_gib": ("KV pools in GiB, one pass each; ample: what 0.9 of the GPU's memory leaves (1 GiB on the CPU)", str)}


CHAT = dict(shape=("qwen2-7b", "tiny"), conversations=(128, 24), turns=(6, 4), system_len=(2048, 96),
            user_len=(256, 24), reply_len=(128, 16), in_flight=(16, 3))
TIER_SETTINGS = ("off", "host", "host+disk")


def chat_turns(args, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each conversation's user messages (fixed seed)."""
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    users = [[[rng.randrange(3, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return system, users


def run_chat(folder: Path, kv: str, tiers: str, args, system: list[int], users, pool_blocks: int,
             disk: Path) -> dict:
    """One run of the chat work on a fresh engine (module docstring)."""
    shutil.rmtree(disk, ignore_errors=True)
    ws_bytes = args.working_set_tokens * args.kv_bytes[kv]
    eng = EngineCore(EngineConfig(
        model=str(folder), device=args.device, dtype="bf16" if args.device == "cuda" else "fp32",
        kv_cache_dtype=kv, num_kv_blocks=pool_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens, decode_stall_factor=0.0,
        kv_host_gib=0.0 if tiers == "off" else args.host_gib,
        kv_disk_dir=str(disk) if tiers == "host+disk" else None,
        kv_disk_gib=1.5 * ws_bytes / 2**30 if tiers == "host+disk" else None))
    eng.generate([system[:32]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.block_manager.reset_prefix_cache()
    sp = SamplingParams(max_tokens=args.reply_len, temperature=0, ignore_eos=True)
    history = [system + users[c][0] for c in range(args.conversations)]
    order = [(c, t) for t in range(args.turns) for c in range(args.conversations)]
    busy: dict[str, tuple[int, int, float]] = {}  # request id -> (conversation, turn, arrival)
    active, replies, ttft = set(), {}, []
    generated, next_item = 0, 0
    before = eng.stats()
    waits_before = eng.kv_tiers.counts.reuse_waits if eng.kv_tiers is not None else 0
    sync(args.device)
    t0 = time.perf_counter()
    while next_item < len(order) or busy:
        while len(busy) < args.in_flight and next_item < len(order) and order[next_item][0] not in active:
            c, t = order[next_item]
            next_item += 1
            rid = f"c{c}-t{t}"
            busy[rid] = (c, t, time.perf_counter())
            active.add(c)
            replies[rid] = []
            eng.add_request(rid, history[c], sp)
        outs = eng.step()
        for o in outs:
            c, t, arrival = busy[o.request_id]
            if not replies[o.request_id]:
                ttft.append(time.perf_counter() - arrival)
            replies[o.request_id] += o.new_token_ids
            generated += len(o.new_token_ids)
            if o.finished:
                del busy[o.request_id]
                active.discard(c)
                if t + 1 < args.turns:
                    history[c] = history[c] + replies[o.request_id] + users[c][t + 1]
    sync(args.device)
    wall = time.perf_counter() - t0
    after = eng.stats()
    tier_hits = {k: v - before.kv_tier_hit_tokens.get(k, 0) for k, v in after.kv_tier_hit_tokens.items()}
    readbacks = after.kv_readbacks - before.kv_readbacks
    reuse_waits = (eng.kv_tiers.counts.reuse_waits - waits_before) if eng.kv_tiers is not None else 0
    eng.close()
    del eng
    gc.unfreeze()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    ttft.sort()
    return dict(wall_s=wall, tok_per_s=generated / wall, ttft_p50_ms=1e3 * ttft[len(ttft) // 2],
                ttft_p99_ms=1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                pool_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits - sum(tier_hits.values()),
                host_hit_tokens=tier_hits.get("host", 0), disk_hit_tokens=tier_hits.get("disk", 0),
                prompt_tokens=after.prefix_cache_queries - before.prefix_cache_queries,
                preemptions=after.num_preemptions - before.num_preemptions,
                # a read-back's time from its start to its blocks landing, on average
                readback_ms=1e3 * (after.kv_readback_seconds - before.kv_readback_seconds) / readbacks
                if readbacks else float("nan"),
                reuse_waits=reuse_waits)  # blocks handed out while their copy down was in flight


def readback_cost(folder: Path, kv: str, args, pool_blocks: int, rounds: int = 3, steps: int = 30) -> dict:
    """Decode steps of --in-flight rows alone and with a read-back issued before each (module
    docstring): the median step time of each over `rounds` alternated rounds of `steps` steps."""
    eng = EngineCore(EngineConfig(
        model=str(folder), device=args.device, dtype="bf16" if args.device == "cuda" else "fp32",
        kv_cache_dtype=kv, num_kv_blocks=pool_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens, kv_host_gib=args.host_gib))
    tiers, bm = eng.kv_tiers, eng.block_manager
    assert tiers is not None
    # a conversation's own history at its end: the most a read-back of this work moves
    chain = min(-(-args.turns * (args.user_len + args.reply_len) // bm.block_size), tiers.host.num_slots)
    rng = random.Random(1)
    sp = SamplingParams(max_tokens=2 * rounds * steps + 64, temperature=0, ignore_eos=True)
    for i in range(args.in_flight):
        eng.add_request(f"d{i}", [rng.randrange(3, 1000) for _ in range(128)], sp)
    for _ in range(64):  # until every row decodes
        eng.step()
        if len(eng.scheduler.running) == args.in_flight and not eng.stats().step_prompt_tokens:
            break
    times: dict[bool, list[float]] = {False: [], True: []}
    in_flight: list[tuple] = []  # (transfer, blocks) of read-backs not yet landed

    def release(wait: bool) -> None:
        for transfer, blocks in list(in_flight):
            if wait:
                transfer.wait()
            if transfer.done():
                bm.publish(blocks, [])  # back to the free queue, unnamed (their bytes are no block's)
                in_flight.remove((transfer, blocks))

    for _ in range(rounds):
        for loading in (False, True):
            for _ in range(steps):
                if loading:
                    blocks = bm.take_blocks(chain)
                    transfer = tiers.copier.load(list(range(len(blocks))), blocks)
                    in_flight.append((transfer, blocks))
                t0 = time.perf_counter()
                eng.step()
                times[loading].append(time.perf_counter() - t0)
                if loading:
                    transfer.before_next_step()  # the next step waits for it, as for a published read-back
                release(wait=False)
            release(wait=True)
    sync(args.device)
    block_bytes = tiers.block_bytes
    eng.close()
    del eng, tiers
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    alone, loaded = (1e3 * statistics.median(times[k]) for k in (False, True))
    return dict(blocks=chain, mib=chain * block_bytes / 2**20, step_ms=alone, readback_step_ms=loaded,
                ratio=loaded / alone)


def chat_main(args) -> int:
    for dest, values in CHAT.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, type(values[0])(values[int(args.tiny)]))
    args.device = args.device or default_device()
    arch, shape = SHAPES[args.shape]
    system, users = chat_turns(args, shape["vocab_size"])
    history_end = args.turns * (args.user_len + args.reply_len)  # each conversation's own tokens at its end
    args.working_set_tokens = args.system_len + args.conversations * history_end
    bs = EngineConfig().block_size
    pool_blocks = max(-(-args.working_set_tokens // bs) * args.pool_share,
                      args.in_flight * -(-(args.system_len + history_end) // bs) + 1)
    pool_blocks = int(pool_blocks)
    kvs = args.kv.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp) / "model", arch, shape, torch.bfloat16 if args.device == "cuda" else torch.float32,
                             max_len=max(4096, args.system_len + history_end + 16))
        cfg = json.loads((Path(tmp) / "model" / "config.json").read_text())
        heads, layers = cfg["num_key_value_heads"], cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        args.kv_bytes = {kv: KVCache.bytes_per_block(num_layers=layers, block_size=1, num_kv_heads=heads,
                                                     head_dim=head_dim, kv_cache_dtype=kv) for kv in kvs}
        if args.host_gib is None:
            args.host_gib = 1.1 * args.working_set_tokens * args.kv_bytes["int8"] / 2**30
        print(f"# {args.device}: chat work, {args.shape}-shaped random {arch} ({params / 1e9:.2f}B params); "
              f"{args.conversations} conversations x {args.turns} turns, system {args.system_len}, user "
              f"{args.user_len}, reply {args.reply_len} tokens, {args.in_flight} turns in flight; working set "
              f"{args.working_set_tokens:,} tokens, pool {pool_blocks * bs:,} tokens ({pool_blocks} blocks), host tier "
              f"{args.host_gib:.4g} GiB (int8: {args.host_gib * 2**30 / args.kv_bytes['int8']:,.0f} tokens, bf16: "
              f"{args.host_gib * 2**30 / args.kv_bytes.get('bf16', 2 * args.kv_bytes['int8']):,.0f})")
        print("| KV | tiers | TTFT p50 ms | TTFT p99 ms | tok/s | prompt tokens from pool / host / disk | preempted "
              "| read-back ms | blocks reused mid-copy |")
        print("|---|---|---|---|---|---|---|---|---|")
        figures: dict = {}
        for kv in kvs:
            for tiers in args.tiers.split(","):
                runs = [run_chat(Path(tmp) / "model", kv, tiers, args, system, users, pool_blocks, Path(tmp) / "disk")
                        for _ in range(args.repeats)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                spread = {k: (min(r[k] for r in runs), max(r[k] for r in runs))
                          for k in ("ttft_p50_ms", "ttft_p99_ms", "tok_per_s")}
                figures[f"{kv} {tiers}"] = dict(median=med, spread=spread, runs=runs)
                print(f"| {kv} | {tiers} | {med['ttft_p50_ms']:.1f} ({spread['ttft_p50_ms'][0]:.1f}-"
                      f"{spread['ttft_p50_ms'][1]:.1f}) | {med['ttft_p99_ms']:.1f} ({spread['ttft_p99_ms'][0]:.1f}-"
                      f"{spread['ttft_p99_ms'][1]:.1f}) | {med['tok_per_s']:,.0f} ({spread['tok_per_s'][0]:,.0f}-"
                      f"{spread['tok_per_s'][1]:,.0f}) | {med['pool_hit_tokens']:,.0f} / {med['host_hit_tokens']:,.0f} "
                      f"/ {med['disk_hit_tokens']:,.0f} of {med['prompt_tokens']:,.0f} | {med['preemptions']:.0f} | "
                      f"{med['readback_ms']:.2f} | {med['reuse_waits']:.0f} |", flush=True)
        if any(t != "off" for t in args.tiers.split(",")):
            print(f"\n| KV | decode step ms, {args.in_flight} rows | the same with a read-back before every step "
                  "| read-back | with / without |")
            print("|---|---|---|---|---|")
            for kv in kvs:
                cost = readback_cost(Path(tmp) / "model", kv, args, pool_blocks)
                figures[f"{kv} readback cost"] = cost
                print(f"| {kv} | {cost['step_ms']:.2f} | {cost['readback_step_ms']:.2f} | {cost['blocks']} blocks, "
                      f"{cost['mib']:.1f} MiB | {cost['ratio']:.3f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(workload="chat", shape=args.shape, figures=figures), indent=2))
    return 0


CHAT_FLAGS = {"conversations": ("conversations", int), "turns": ("turns per conversation", int),
              "system_len": ("tokens of the shared system prompt", int),
              "user_len": ("new tokens of each user turn", int), "reply_len": ("tokens of each reply", int),
              "in_flight": ("turns in flight at once", int), "host_gib": ("the host tier in GiB", float)}


def add_workload_flags(ap) -> None:
    ap.add_argument("--workload", choices=sorted([*PRESETS, "chat"]), default="mixed",
                    help="the work and its defaults (above)")
    for dest, (text, kind) in FLAGS.items():
        shown = "; ".join(f"{w} {PRESETS[w][dest][0]} ({PRESETS[w][dest][1]} with --tiny)" for w in PRESETS)
        ap.add_argument("--" + dest.replace("_", "-"), type=kind, default=None, help=f"{text} (default: {shown})",
                        **({"choices": sorted(SHAPES)} if dest == "shape" else {}))


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model (the tiny shape) and workload")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    add_workload_flags(ap)
    sized = SizedFlags(ap)
    sized.add("--max-num-seqs", 256, 16, "running sequences per step at most")
    sized.add("--max-batched-tokens", 8192, 512, "tokens per step at most (prefill chunks + decodes)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per KV cache dtype; the median is reported")
    ap.add_argument("--kv", default="int8,bf16", help="KV cache dtypes to run, comma-separated")
    ap.add_argument("--tflops", type=float, default=790.0, help="dense bf16 rate for the ideal prefill time")
    ap.add_argument("--decode-stall-factor", type=float, default=0.0,
                    help="the engine's stall bound, off at 0: offline work queued at once wants whole "
                         "budgets (the served bound is measured by benchmarks/serving.py)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="the engine without its prefix cache")
    ap.add_argument("--serve", default="",
                    help="closed-loop gRPC concurrencies, e.g. 64,256 (int8 server) (default: none, not served)")
    ap.add_argument("--hf", type=int, default=0,
                    help="transformers generate_batch on this many requests x 256 (default: 0, no transformers run)")
    ap.add_argument("--single", action="store_true", help="one-user decode tokens/s and TTFT of a 2k prompt")
    ap.add_argument("--out", default=None, help="JSON file for every figure (default: none written)")
    for dest, (text, kind) in CHAT_FLAGS.items():
        shown = f"{CHAT[dest][0]} ({CHAT[dest][1]} with --tiny)" if dest in CHAT else "1.1x the working set in int8 pages"
        ap.add_argument("--" + dest.replace("_", "-"), type=kind, default=None,
                        help=f"--workload chat: {text} (default: {shown})")
    ap.add_argument("--tiers", default=",".join(TIER_SETTINGS),
                    help="--workload chat: the tier settings to run, comma-separated (default: %(default)s)")
    ap.add_argument("--pool-share", type=float, default=0.25,
                    help="--workload chat: the KV pool's share of the working set (at least the turns in flight)")
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    if args.workload == "chat":
        unknown = set(args.tiers.split(",")) - set(TIER_SETTINGS)
        if unknown:
            ap.error(f"--tiers: unknown setting(s) {sorted(unknown)} (one of {', '.join(TIER_SETTINGS)})")
        if args.shape is None:
            args.shape = CHAT["shape"][int(args.tiny)]
        return chat_main(args)
    for dest, (_, kind) in FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, kind(PRESETS[args.workload][dest][int(args.tiny)]))
    args.device = args.device or default_device()
    pools = [None if g == "ample" else float(g) for g in args.kv_gib.split(",")]
    args.kv_gib = pools[0]  # the served run's pool
    arch, shape = SHAPES[args.shape]
    prompts, outs = workload(args.requests, shape["vocab_size"], args.prompt_median, args.prompt_max,
                             args.prefix_len, (args.out_min, args.out_max), prefix_every=args.prefix_every)
    copy_bw = copy_bandwidth(args.device)
    kvs = args.kv.split(",")
    passes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), arch, shape, torch.bfloat16 if args.device == "cuda" else torch.float32,
                             max_len=max(4096, args.prefix_len + args.prompt_max + args.out_max + 16))
        print(f"# {args.device}: {args.workload} work, {args.shape}-shaped random {arch} ({params / 1e9:.2f}B "
              f"params); {args.requests} requests, prompts median {statistics.median(map(len, prompts)):.0f} (max "
              f"{max(map(len, prompts))}) tokens, {sum(map(len, prompts)):,} prompt tokens, outputs "
              f"{args.out_min}-{args.out_max} ({sum(outs):,} tokens); copy bandwidth {copy_bw / 1e12:.2f} TB/s")
        # Served first: the server is a process of its own that gives the GPU back when it exits,
        # while this process keeps what its engines held (after them, `pie serve` found 133.5 of
        # 139.8 GiB in use and refused to start: H200, 2026-12-03).
        served = serve(Path(tmp), prompts, outs, args) if args.serve else []
        for n, pool in enumerate(pools):
            run_args = argparse.Namespace(**{**vars(args), "kv_gib": pool})
            passes["memory ample" if pool is None else f"KV pool {pool:g} GiB"] = {
                kv: run_engine(Path(tmp), kv, prompts, outs, run_args, extra=n == 0 and kv == kvs[0]) for kv in kvs}
        hf = run_hf(Path(tmp), prompts[:args.hf], args.device) if args.hf else None
    weight_bytes = params * (2 if args.device == "cuda" else 4)
    summaries = {}
    for name, results in passes.items():
        if len(passes) > 1:
            print(f"## {name}")
        summaries[name] = report(results, prompts, params, weight_bytes, copy_bw, args.tflops, args.max_num_seqs,
                                 label=f" ({name})" if len(passes) > 1 else "")
    first = next(iter(passes.values()))[kvs[0]]
    extras: dict = {}
    if "single" in first:
        sg = first["single"]
        bound = copy_bw / weight_bytes
        print(f"one user ({kvs[0]}): decode {sg['decode_tok_per_s']:,.0f} tok/s = {100 * sg['decode_tok_per_s'] / bound:.0f}% "
              f"of the weight-bandwidth bound {bound:,.0f} tok/s; TTFT of a {sg['ttft_prompt_tokens']}-token prompt "
              f"{sg['ttft_2k_ms']:.1f} ms")
        extras["single"] = dict(**sg, bound_tok_per_s=bound)
    if hf is not None:
        ours = first["hf_subset_tok_per_s"]
        print(f"first {args.hf} requests x 256 tokens: transformers generate_batch {hf:,.0f} tok/s, "
              f"pie ({kvs[0]}) {ours:,.0f} tok/s: {ours / hf:.1f}x")
        extras["hf"] = dict(requests=args.hf, transformers_tok_per_s=hf, pie_tok_per_s=ours)
    for r in served:
        offline = next(iter(summaries.values()))[kvs[0]]["tok_per_s_median"]
        print(f"gRPC, {r['load']} streams: {r['tok_per_s']:,.0f} tok/s ({100 * r['tok_per_s'] / offline:.0f}% of "
              f"offline), {r['errors']} errors; TTFT p50/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms; "
              f"ITL p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms (p99/p50 {r['itl_p99_ms'] / r['itl_p50_ms']:.1f})")
    extras["served"] = served
    if args.out:
        figures = next(iter(summaries.values())) if len(summaries) == 1 else None
        Path(args.out).write_text(json.dumps(dict(workload=args.workload, shape=args.shape, copy_tbs=copy_bw / 1e12,
                                                  results=figures, passes=summaries, **extras), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
