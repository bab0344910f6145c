"""Offline throughput (issue 5, benchmark 1): our engine with the int8 and the bf16 KV cache against
Hugging Face transformers' continuous batching (`generate_batch`, attention "paged|sdpa"), on the
same random-initialized model and the same requests, in one run.

    python -m benchmarks.throughput            # GPU: Llama-3.2-1B-shaped, 256 requests x 256 tokens
    python -m benchmarks.throughput --tiny     # CPU-sized smoke run of the same code path
    python -m benchmarks.throughput --tiny --skip-hf --repeats 1    # our engine only: no transformers needed
    python -m benchmarks.throughput --skip-hf --kv int8 --shape 4b --tensor-parallel-size 2   # over GPUs 0 and 1

Each engine runs the workload --repeats times after a short warm-up; the median run is reported,
with the spread of all runs. With a small --kv-gib the pool, not the batch cap,
limits the batch and requests are preempted: the capacity run of issue 5.

Workload: random prompt ids of length uniform in [--min-prompt, --max-prompt], --max-tokens
generated each, EOS ignored, greedy, fixed seed. Prints generated tokens/s, the ratio to
transformers, and the fraction of the memory roofline: per decode step the weights are read once
and every running sequence's K/V once, so the ideal step time is (weight bytes + KV bytes) over the
copy bandwidth measured in the same run.

The model is made and saved by transformers when transformers runs too (so both sides load the
same weights); with --skip-hf by our own model code and exporter, without transformers.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch

from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser
from pie.engine.config import DEFAULT_MODEL, EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.runner.kv_cache import KVCache
from pie.engine.sampling_params import SamplingParams
from pie.model.config import ModelConfig
from pie.model.llama import LlamaForCausalLM
from pie.training.export import export_hf

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=32000, tie_word_embeddings=True)
# Qwen3-4B's dimensions in a Llama (no q/k norms: a step's work is the same to within them).
LLAMA_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True)
SHAPES = {"llama-1b": LLAMA_1B, "4b": LLAMA_4B}
TINY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=768, vocab_size=4096, tie_word_embeddings=True)
# Next to nothing to compute: on the CPU, a step's time is then the engine's host (Python) work.
# (its vocabulary the bundled tokenizer's size: an embedding smaller than the tokenizer is refused at start)
MICRO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=64, vocab_size=2560, tie_word_embeddings=True)


def build_model(folder: Path, shape: dict, dtype: torch.dtype, *,
                made_by: Literal["transformers", "pie"]) -> int:
    """A random-initialized Llama of `shape` in `folder` (Hugging Face layout, `dtype` weights, the
    bundled tokenizer: its text is meaningless here; ids past its vocabulary decode to nothing);
    returns the parameter count (a tied lm_head counted once).

    made_by="transformers": transformers' LlamaForCausalLM with its init, saved by transformers:
    what a comparison with transformers loads, so both sides have the same weights. "pie": our
    LlamaForCausalLM (model/llama.py, `init_weights`) written by training.export.export_hf, which
    needs no transformers; the weights' values differ, the shapes and the work per step do not."""
    torch.manual_seed(0)
    if made_by == "transformers":
        from transformers import LlamaConfig
        from transformers import LlamaForCausalLM as HFLlamaForCausalLM

        hf_cfg = LlamaConfig(**shape, max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0)
        hf_model = HFLlamaForCausalLM(hf_cfg).to(dtype)
        hf_model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(DEFAULT_MODEL) / name, folder / name)
        return sum(p.numel() for p in hf_model.parameters())
    cfg = ModelConfig.from_hf(dict(model_type="llama", architectures=["LlamaForCausalLM"], **shape,
                                   max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0))
    on_gpu = torch.cuda.is_available()  # initializing the 4B shape's weights takes minutes on a CPU
    with torch.device("cuda" if on_gpu else "cpu"):
        model = LlamaForCausalLM(cfg)
    model.init_weights()
    export_hf(model, cfg, DEFAULT_MODEL, folder, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    del model
    if on_gpu:
        torch.cuda.empty_cache()  # the engine sizes its KV pool from the memory left free
    return params


def copy_bandwidth(device: str) -> float:
    src = torch.empty(1 << 30 if device == "cuda" else 1 << 27, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * n / (time.perf_counter() - t0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_adapters(folder: Path, n: int, rank: int, out: Path | None = None) -> tuple[tuple[str, str], ...]:
    """n random LoRA adapters of rank `rank` on every projection of the model in `folder`, in
    PEFT's format (deltas of about a hundredth of the base's), as (name, folder) pairs, written
    under `out` (default: `folder`)."""
    from safetensors.torch import save_file

    from pie.model.lora import TARGETS, part_sizes

    cfg = ModelConfig.from_hf(folder / "config.json")
    gen = torch.Generator().manual_seed(0)
    made = []
    for i in range(n):
        where = (out or folder) / f"lora-{n}-{i}"  # one set per count
        where.mkdir()
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for module, (proj, part) in TARGETS.items():
                width, outs = part_sizes(cfg)[proj]
                block = "self_attn" if proj in ("qkv_proj", "o_proj") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, width, generator=gen) / width ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(outs[part], rank, generator=gen) * 0.01
        save_file(tensors, str(where / "adapter_model.safetensors"))
        (where / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                             "target_modules": sorted(TARGETS)}))
        made.append((f"lora-{i}", str(where)))  # (named alike in every set: the engine sees one set)
    return tuple(made)


def run_ours(folder: Path, prompts, args, kv: str, loras: tuple[tuple[str, str], ...] = ()) -> dict:
    eng = EngineCore(EngineConfig(model=str(folder), device=args.device, dtype="bf16" if args.device == "cuda" else "fp32",
                                 kv_cache_dtype=kv, gpu_memory_fraction=args.gpu_memory_fraction,
                                 kv_cache_memory_bytes=None if args.kv_gib is None else int(args.kv_gib * 2**30),
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                 enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
                                 max_loras=len(loras), max_lora_rank=args.lora_rank, loras=loras))
    # with adapters: the requests spread over them uniformly, every step mixing them
    names = [loras[i % len(loras)][0] for i in range(len(prompts))] if loras else None
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    eng.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    steps = _record_steps(eng)
    runs = []
    for _ in range(args.repeats):
        preempted = eng.stats().num_preemptions
        eng.block_manager.reset_prefix_cache()  # every repeat computes its prompts (no cache hits)
        steps.clear()
        sync(args.device)
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp, names)
        sync(args.device)
        wall = time.perf_counter() - t0
        runs.append((wall, sum(len(o) for o in outs), eng.stats().num_preemptions - preempted, list(steps)))
    runs.sort(key=lambda r: r[0])
    wall, tokens, preemptions, timeline = runs[len(runs) // 2]  # the median run
    kernels = _lora_kernel_time(eng, prompts[:64], names[:64]) if loras and args.device == "cuda" else None
    del eng.step, eng.scheduler.schedule  # the timing wrappers hold the engine: let it go
    eng.close()  # tensor-parallel workers end here
    mode = " (eager)" if args.enforce_eager else ""
    if loras:
        mode += f", {len(loras)} LoRA adapters of rank {args.lora_rank}"
    if args.tensor_parallel_size > 1:
        mode += f" (tensor parallel {args.tensor_parallel_size})"
    return dict(name=f"pie, {kv} KV cache{mode}", wall_s=wall, tokens=tokens, tok_per_s=tokens / wall,
                all_tok_per_s=[r[1] / r[0] for r in runs], preemptions=preemptions,
                kv_blocks=eng.block_manager.num_total_blocks,
                kv_tokens=eng.block_manager.num_total_blocks * eng.config.block_size,
                timeline=_summarize(timeline, wall) + (f"; {kernels}" if kernels else ""))


def _lora_kernel_time(eng: EngineCore, prompts, names) -> str:
    """The LoRA kernels' share of the GPU's kernel time per engine step, over a short run of these
    requests under torch.profiler (kernels replayed from CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile

    steps, step = [0], eng.step

    def counted():
        steps[0] += 1
        return step()

    eng.step = counted
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), names)
        torch.cuda.synchronize()
    eng.step = step
    # self time: a kernel's own; an operator's excludes the kernels it launched (no double count)
    times = [(e.key, e.self_device_time_total) for e in prof.key_averages()]
    shrink = sum(t for key, t in times if "_shrink_kernel" in key)
    expand = sum(t for key, t in times if "_expand_kernel" in key)
    total = sum(t for _, t in times)
    n = steps[0]
    return (f"LoRA kernels {(shrink + expand) / n:.0f} us (shrink {shrink / n:.0f}, expand {expand / n:.0f}) of "
            f"{total / n:.0f} us GPU time per step ({100 * (shrink + expand) / max(total, 1e-9):.1f}%, {n} steps "
            f"of 64 requests x 32 tokens)")


def _record_steps(eng: EngineCore) -> list[tuple[float, int, int]]:
    """Wraps eng.step: each call appends (seconds, prompt tokens scheduled, decode rows scheduled).
    With async scheduling a call's time is the host's pace, which the device sets when it is the
    slower side (a call waits for the step before it)."""
    steps: list[tuple[float, int, int]] = []
    schedule, step = eng.scheduler.schedule, eng.step
    last = [0, 0]

    def counting_schedule():
        out = schedule()
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1 and s.start >= s.request.num_prompt_tokens)
        last[:] = [out.num_batched_tokens - decodes, decodes]
        return out

    def timed_step():
        last[:] = [0, 0]
        t = time.perf_counter()
        outs = step()
        steps.append((time.perf_counter() - t, *last))
        return outs

    eng.scheduler.schedule, eng.step = counting_schedule, timed_step
    return steps


def _summarize(steps: list[tuple[float, int, int]], wall: float) -> str:
    """Where the wall time went: steps that carried prompt tokens, pure decode steps (with their
    median), and time outside steps (adding requests, collecting outputs)."""
    mixed = [s for s in steps if s[1] > 0]
    decode = sorted(s[0] for s in steps if s[1] == 0 and s[2] > 0)
    other = wall - sum(s[0] for s in steps)
    med = 1e3 * decode[len(decode) // 2] if decode else 0.0
    return (f"{len(mixed)} steps with prompt tokens ({sum(s[1] for s in mixed):,} tokens) "
            f"{sum(s[0] for s in mixed):.2f} s; {len(decode)} decode steps {sum(decode):.2f} s "
            f"(median {med:.2f} ms, max {1e3 * (decode[-1] if decode else 0):.1f} ms); "
            f"{len(steps) - len(mixed) - len(decode)} empty steps; outside steps {other:.2f} s")


def run_hf(folder: Path, prompts, args) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="paged|sdpa").to(args.device)
    gen = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                           use_cuda_graph=False)
    model.generate_batch(inputs=prompts[:4], generation_config=gen)  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen)
    sync(args.device)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in out.values())
    return dict(name="transformers generate_batch (paged|sdpa)", wall_s=wall, tokens=tokens, tok_per_s=tokens / wall)


def roofline_tok_per_s(params: int, shape: dict, prompts, args, kv: str, copy_bw: float) -> float:
    """Tokens/s if every decode step only moved the weights once and each sequence's K/V once, at
    the measured copy bandwidth (average context: prompt + half the generated tokens)."""
    weight_bytes = params * (2 if args.device == "cuda" else 4)
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    per_token = KVCache.bytes_per_block(num_layers=shape["num_hidden_layers"], block_size=1,
                                        num_kv_heads=shape["num_key_value_heads"], head_dim=head_dim, kv_cache_dtype=kv)
    batch = min(args.max_num_seqs, len(prompts))
    avg_ctx = sum(len(p) for p in prompts) / len(prompts) + args.max_tokens / 2
    step_bytes = weight_bytes + batch * avg_ctx * per_token
    return batch / (step_bytes / (copy_bw / 2))  # copy_bw counts read + write; a step only reads


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU-sized model (hidden 256, 4 layers, vocab 4096) and workload")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES),
                    help="model shape: Llama-3.2-1B's (vocabulary 32,000), or Qwen3-4B's dimensions in a Llama; "
                         "--tiny overrides it")
    sized = SizedFlags(ap)
    sized.add("--requests", 256, 16, "requests in the workload")
    sized.add("--min-prompt", 100, 16, "shortest prompt, in tokens")
    sized.add("--max-prompt", 512, 64, "longest prompt, in tokens")
    sized.add("--max-tokens", 256, 32, "tokens generated per request")
    sized.add("--max-num-seqs", 256, 16, "running sequences per step at most (the batch cap)")
    sized.add("--max-batched-tokens", 8192, 1024, "tokens per step at most (prefill chunks + decodes)")
    sized.add("--kv-gib", None, 0.25, "KV pool in GiB", type=float,
              shown=("on CUDA what --gpu-memory-fraction leaves, on the CPU 1 GiB", "0.25"))
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                    help="share of the GPU's memory for weights, activations and the KV pool")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: decode steps run eagerly")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the median is reported")
    ap.add_argument("--kv", default="int8,bf16", help="KV cache dtypes to run, comma-separated")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="processes (GPUs) sharing the model, as pie serve's flag")
    ap.add_argument("--skip-hf", action="store_true",
                    help="only our engine: no transformers run (and no transformers needed)")
    ap.add_argument("--loras", default="", metavar="N,...",
                    help="also run each KV dtype with N random LoRA adapters on every projection (the requests "
                         "spread over them uniformly), for each N given, e.g. 1,8 (default: none)")
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of those adapters")
    ap.add_argument("--out", default=None, help="JSON file for every figure (default: none written)")
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    args.device = args.device or default_device()
    shape = TINY if args.tiny else SHAPES[args.shape]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    copy_bw = copy_bandwidth(args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # transformers' weights where transformers runs too (both sides load the same); else ours.
        params = build_model(folder, shape, torch.bfloat16 if args.device == "cuda" else torch.float32,
                             made_by="pie" if args.skip_hf else "transformers")
        print(f"# {args.device}: random Llama {params / 1e6:.0f}M params, {args.requests} requests, prompts "
              f"{args.min_prompt}-{args.max_prompt} tokens, {args.max_tokens} generated; copy bandwidth "
              f"{copy_bw / 1e12:.2f} TB/s")
        if not args.skip_hf:
            rows.append(run_hf(folder, prompts, args))
        counts = [0] + [int(n) for n in args.loras.split(",") if n]
        adapters = {n: random_adapters(folder, n, args.lora_rank) if n else () for n in sorted(set(counts))}
        for kv in args.kv.split(","):
            for n in counts:
                r = run_ours(folder, prompts, args, kv, adapters[n])
                gc.unfreeze()  # the engine froze what was alive at its start, itself included
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()  # the next engine sizes its pool from free memory
                r["roofline_frac"] = r["tok_per_s"] / roofline_tok_per_s(params, shape, prompts, args, kv, copy_bw)
                if n:
                    r["vs_base"] = r["tok_per_s"] / rows[-1 - (counts.index(n) - 1)]["tok_per_s"]
                rows.append(r)
    base = rows[0]["tok_per_s"] if not args.skip_hf else None
    print("| engine | tokens/s (median) | spread | x transformers | memory roofline | wall s | KV pool tokens | preemptions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['tok_per_s'] / base:.1f}x" if base else "-"
        frac = f"{100 * r['roofline_frac']:.0f}%" if "roofline_frac" in r else "-"
        pool = f"{r['kv_tokens']:,}" if "kv_tokens" in r else "-"
        spread = (f"{min(r['all_tok_per_s']):,.0f}-{max(r['all_tok_per_s']):,.0f}"
                  if "all_tok_per_s" in r else "-")
        print(f"| {r['name']} | {r['tok_per_s']:,.0f} | {spread} | {ratio} | {frac} | {r['wall_s']:.1f} | {pool} | "
              f"{r.get('preemptions', '-')} |")
    for r in rows:
        if "vs_base" in r:
            print(f"{r['name']}: {r['vs_base']:.3f}x the base model's tokens/s")
    for r in rows:
        if "timeline" in r:
            print(f"{r['name']}: {r['timeline']}")
    ours = {r["name"]: r for r in rows if "kv_tokens" in r}
    if "pie, int8 KV cache" in ours and "pie, bf16 KV cache" in ours:
        i8, b16 = ours["pie, int8 KV cache"], ours["pie, bf16 KV cache"]
        print(f"capacity int8 / bf16 for the same memory: {i8['kv_tokens'] / b16['kv_tokens']:.2f}x; "
              f"throughput int8 / bf16: {i8['tok_per_s'] / b16['tok_per_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(copy_tbs=copy_bw / 1e12, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
