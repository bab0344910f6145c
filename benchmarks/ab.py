"""The A/B gate: the working tree against base commits on one GPU, in one call, at the defaults.

    git archive <commit> | tar -x -C .ab/<commit>        # here: each base tree (gpu.sh ab's help says how to carry it)
    python -m benchmarks.ab --base .ab/65bef9d [--base .ab/8945f39] [--mode full] [--rounds 3]
    python -m benchmarks.ab --base DIR --tiny             # CPU-sized smoke run of the same code path
    python -m benchmarks.ab --variant batch_invariant=true --workloads offline-int8,burst,stream-int8
                                                          # this tree with a setting on against itself

Every tree runs the same work (the long-context work: 256 requests queued at once, log-normal
prompts of median 800 tokens, a third after one shared 1,500-token prefix, 128-1,024 tokens out,
greedy, EOS ignored) on one random-weight model (--shape; default the 7B-class GQA shape: 28 layers,
28 query / 4 KV heads, head dim 128, qkv bias) with everything at that tree's defaults but the
batch (--max-num-seqs, --max-num-batched-tokens, the same for all) and what a workload sets:

    quick   offline-int8, offline-bf16 (memory ample), burst (256 streams at once, `pie serve`)
    full    quick's, offline-int8-8g, offline-bf16-8g (the KV pool fixed at --kv-gib, 8 GiB), poisson-4, poisson-8
            (arrivals at 4 and 8 requests/s for --arrival-seconds, 30), stream-int8, stream-bf16 (one
            request decoding), ttft-4k (one 4,096-token prompt, cold: the time to its first token)

The trees run alternately, round after round, each in a process of its own whose import path holds
that tree alone (its `pie.*`, or the top-level packages of a tree from before the pie.* names):
two trees' engines (or servers) are up together, each with --memory-fraction of the GPU, and take
turns, so one round of every tree is measured under the same conditions. Workloads that need the
same engine share it (offline-int8, stream-int8 and ttft-4k one int8 engine with the default pool;
offline-bf16 and stream-bf16 one bf16 engine; the -8g ones one engine each; burst and Poisson one
server): each tree starts 5 engines or servers for the full table, not 10. The served load comes
from this tree's client for every server (the contract is the same).

The full table takes longer than one 10-minute GPU call: `--resume EARLIER.json` (a call's --out)
takes every workload that call completed, runs those asked for (--mode or --workloads) that it
lacks, and tables and writes them all, refusing where the trees' code (a fingerprint of it), the
device or the work differ: calls that each run some workloads build one table, each row's trees
measured in one call.

`--variant FIELD=VALUE[,FIELD=VALUE]` (repeatable) adds the working tree once more with those
EngineConfig fields set (the servers get them as flags: `batch_invariant=true` is
`--batch-invariant`), labelled by them: what a setting costs, measured the same way. It takes the
place of --base or goes beside it. One field is not EngineConfig's: `loras=N` (offline workloads
only) makes N random LoRA adapters of rank `max_lora_rank` (default 16) on every projection, loads
them all, and spreads the long work's requests over them uniformly, so every step mixes them (issue
61: `--variant loras=1 --variant loras=8` against the base model alone).

It prints one table: per workload and figure, each tree's median and spread (min-max) over the
rounds, the ratio to the working tree, and a verdict: REGRESSION where the working tree is worse
than a base beyond both spreads (its best round worse than the base's worst), better where the
reverse holds, else same. --out writes every round's figures as JSON. Stopped by SIGTERM (a time
limit's `timeout`), it still prints the table of the rounds that finished, every tree's, and says
so; the exit status is then 1.

Internal: `ab.py --worker SPEC.json` is one tree's offline engine (run by this script with that tree's
import path); it reads "run WHAT" lines on stdin and answers each with one JSON line of figures.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]

# name: (family, config fields). qwen2-7b is Qwen2-7B's geometry (its attention has q/k/v biases).
SHAPES = {
    "qwen2-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)),
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
    "tiny": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)),
}

# Offline workloads: (kv_cache_dtype, whether the KV pool is fixed at --kv-gib (else the tree's
# default sizing: memory ample), what runs).
OFFLINE = {
    "offline-int8": ("int8", False, "long"), "offline-bf16": ("bf16", False, "long"),
    "offline-int8-8g": ("int8", True, "long"), "offline-bf16-8g": ("bf16", True, "long"),
    "stream-int8": ("int8", False, "stream"), "stream-bf16": ("bf16", False, "stream"),
    "ttft-4k": ("int8", False, "ttft"),
}
# Served workloads (int8 pages, the server's default): arrival rate in requests/s, None = a burst.
SERVED = {"burst": None, "poisson-4": 4.0, "poisson-8": 8.0}
MODES = {
    "quick": ["offline-int8", "offline-bf16", "burst"],
    "full": ["offline-int8", "offline-bf16", "offline-int8-8g", "offline-bf16-8g", "burst", "poisson-4",
             "poisson-8", "stream-int8", "stream-bf16", "ttft-4k"],
}
# Figure: (key in a round's result, unit, True where higher is better).
FIGURES = {
    "long": [("tok_per_s", "tok/s", True)],
    "stream": [("tok_per_s", "tok/s", True)],
    "ttft": [("ttft_ms", "ms", False)],
    "served": [("tok_per_s", "tok/s", True), ("ttft_p50_ms", "ms", False), ("ttft_p99_ms", "ms", False),
               ("itl_p50_ms", "ms", False), ("itl_p99_ms", "ms", False), ("itl_p99_over_p50", "x", False)],
}


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    """Waits for a process asked to end, killing it past `timeout` seconds."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tree_env(tree: Path, site: str | None) -> dict[str, str]:
    """The environment of a process that runs `tree`'s code: its root and clients/ first on the
    import path (a tree of either layout), the machine's extra wheels (.site) before them."""
    path = [p for p in (site, str(tree), str(tree / "clients")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


def server_module(tree: Path) -> str:
    return "pie.service.cli" if (tree / "clients" / "pie" / "service").exists() else "service.cli"


# ---------------------------------------------------------------------------------------------
# The worker: one tree's offline engine. Imports nothing of this checkout, only the tree's engine.


def _engine_api():
    """(EngineCore, EngineConfig, SamplingParams) of the tree on the import path, whichever
    generation of names it has."""
    try:
        from pie.engine.config import EngineConfig
        from pie.engine.sampling_params import SamplingParams

        try:
            from pie.engine.core.engine_core import EngineCore
        except ImportError:
            from pie.engine.core import EngineCore  # type: ignore[attr-defined,no-redef]  # before the sub-packages
    except ImportError:
        from engine.config import EngineConfig  # type: ignore[no-redef]  # before the pie.* names
        from engine.sampling_params import SamplingParams  # type: ignore[no-redef]
        try:
            from engine.core import EngineCore  # type: ignore[no-redef]
        except ImportError:
            from engine.engine import LLMEngine as EngineCore  # type: ignore[no-redef]  # before EngineCore
    return EngineCore, EngineConfig, SamplingParams


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run_long(eng, SamplingParams, prompts, outs, tag: str, adapters: list[str] | None = None) -> dict:
    eng.block_manager.reset_prefix_cache()
    _sync()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, outs)):
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        if adapters:  # (only the working tree's variants have them; older trees lack the keyword)
            eng.add_request(f"{tag}-{i}", p, sampling, adapter=adapters[i % len(adapters)])
        else:
            eng.add_request(f"{tag}-{i}", p, sampling)
    tokens = 0
    while eng.has_unfinished():
        for o in eng.step():
            tokens += len(o.new_token_ids)
    _sync()
    wall = time.perf_counter() - t0
    return dict(tok_per_s=tokens / wall, tokens=tokens, wall_s=wall)


def _run_stream(eng, SamplingParams, vocab: int, tag: str, prompt_len: int = 512, new: int = 512) -> dict:
    """One request decoding alone: tokens after the first over the time after the first."""
    import random

    rng = random.Random(1)
    eng.add_request(tag, [rng.randrange(3, vocab) for _ in range(prompt_len)],
                    SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    first = None
    tokens = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids and first is None:
                _sync()
                first, tokens = time.perf_counter(), len(o.new_token_ids)
            elif o.new_token_ids:
                tokens += len(o.new_token_ids)
    _sync()
    return dict(tok_per_s=(tokens - 1) / (time.perf_counter() - first))


def _run_ttft(eng, SamplingParams, vocab: int, tag: str, length: int = 4096) -> dict:
    """One cold prompt of `length` tokens: the time from its arrival to its first token (median of 3)."""
    import random

    rng = random.Random(2)
    times = []
    for k in range(3):
        eng.block_manager.reset_prefix_cache()
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        _sync()
        t0 = time.perf_counter()
        eng.add_request(f"{tag}-{k}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        _sync()
        times.append(time.perf_counter() - t0)
    return dict(ttft_ms=1e3 * statistics.median(times))


def parse_variant(text: str) -> dict:
    """"a=true,b=4" -> {"a": True, "b": 4}: EngineConfig fields (bools, ints, floats, else strings)."""
    fields = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--variant {text!r}: FIELD=VALUE[,FIELD=VALUE] expected, got {item!r}")
        value: object = raw.strip()
        if raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    pass
        fields[key.strip()] = value
    return fields


def server_flags(fields: dict) -> list[str]:
    """EngineConfig fields as `pie serve` flags: True is the flag alone; False has none to give."""
    flags = []
    for key, value in fields.items():
        if key == "loras":
            raise ValueError("loras=N: the offline workloads' variant (the served ones would need the adapters "
                             "made where the server runs)")
        flag = "--" + key.replace("_", "-")
        if value is False:
            raise ValueError(f"{key}=false: a server flag turns a setting on; compare without it instead")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def worker(spec: dict) -> int:
    """Builds the engine of `spec`, warms it up, answers every "run WHAT" line (WHAT: long, stream or
    ttft, the work of the offline workloads this engine serves) with one JSON line of figures."""
    answers = os.fdopen(os.dup(1), "w")  # the protocol's own channel; whatever else writes to stdout
    os.dup2(2, 1)  # (logs, progress bars) goes to the log with stderr
    sys.stdout = sys.stderr
    EngineCore, EngineConfig, SamplingParams = _engine_api()
    cfg = dict(model=spec["model"], device=spec["device"], kv_cache_dtype=spec["kv"],
               max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"])
    if spec["device"] == "cuda":
        cfg["gpu_memory_fraction"] = spec["memory_fraction"]
    else:
        cfg["dtype"] = "fp32"
    if spec["kv_gib"] is not None:
        cfg["kv_cache_memory_bytes"] = int(spec["kv_gib"] * 2**30)
    fields = dict(spec.get("fields", {}))  # a --variant's settings
    adapters = None
    if fields.get("loras"):  # N random adapters, made beside the worker's log (the module docstring)
        from benchmarks.throughput import random_adapters

        count, rank = fields.pop("loras"), fields.setdefault("max_lora_rank", 16)
        made = random_adapters(Path(spec["model"]), count, rank, out=Path(tempfile.mkdtemp(prefix="pie-ab-lora-")))
        fields.update(loras=made, max_loras=count)
        adapters = [name for name, _ in made]
    cfg.update(fields)
    eng = EngineCore(EngineConfig(**cfg))
    vocab = spec["vocab"]
    prompts, outs = spec["prompts"], spec["outs"]
    eng.generate([p[:32] for p in prompts[:4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for n, line in enumerate(sys.stdin):
        command, _, what = line.strip().partition(" ")
        if command != "run":
            break
        tag = f"r{n}"
        if what == "long":
            result = _run_long(eng, SamplingParams, prompts, outs, tag, adapters)
        elif what == "stream":
            result = _run_stream(eng, SamplingParams, vocab, tag)
        elif what == "ttft":
            result = _run_ttft(eng, SamplingParams, vocab, tag, spec["ttft_tokens"])
        else:
            raise ValueError(f"unknown work {what!r}")
        print(json.dumps(result), file=answers, flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The driver.


def build_model(folder: Path, shape: str, max_len: int) -> None:
    """A random-weight model in bf16 (fp32 for the tiny shape), saved by transformers, with the
    bundled tokenizer."""
    import shutil

    import torch
    import transformers

    family, fields = SHAPES[shape]
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[family]
    cfg = cls(**fields, max_position_embeddings=max_len, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.float32 if shape == "tiny" else torch.bfloat16
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(folder)
    bundled = ROOT / "model" / "bundled" / "stories-7m"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / name, folder / name)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engines size their KV pools from what the device has free


# Written into a --model-cache folder once its model is complete.
BUILT = ".built"


class Arm(NamedTuple):
    """What one column of the table runs: a tree, and the EngineConfig fields set on it (a --variant)."""

    tree: Path
    fields: dict


class Worker:
    """One tree's offline engine in its own process (`ab.py --worker`)."""

    def __init__(self, tree: Path, spec: dict, site: str | None, log: Path) -> None:
        self.log = log.open("a")
        spec_file = log.with_suffix(".json")  # the prompts: too long for a command line
        spec_file.write_text(json.dumps(spec))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_file)],
                                     cwd=tempfile.gettempdir(), env=tree_env(tree, site), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.wait()}); its log ends:\n{_tail(Path(self.log.name))}")
        return json.loads(line)

    def run(self, what: str) -> dict:
        self.proc.stdin.write(f"run {what}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self, wait: bool = True) -> None:
        """Ends the worker: after its current run, or at once (`wait` False: the call is stopping)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the worker's loop ends with its input
            _wait_or_kill(self.proc, 120 if wait else 0)
        self.log.close()


class Server:
    """One tree's `pie serve` (int8 pages, its defaults but the batch), ready to take load."""

    def __init__(self, tree: Path, args, site: str | None, log: Path, memory_fraction: float,
                 fields: dict | None = None) -> None:
        from benchmarks.serving import free_port

        self.log = log.open("a")
        port = free_port()
        cmd = [sys.executable, "-m", server_module(tree), "serve", "--port", str(port), "--model", args.model_dir,
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--max-waiting", str(4 * args.requests), "--log-level", "warning", "--device", args.device]
        if args.device == "cuda":
            cmd += ["--gpu-memory-fraction", str(memory_fraction)]
        else:
            cmd += ["--dtype", "fp32"]
        cmd += server_flags(fields or {})
        self.proc = subprocess.Popen(cmd, cwd=tree, env=tree_env(tree, site), stdout=self.log, stderr=self.log)
        self.address = f"127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 900) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited ({self.proc.returncode}); its log ends:\n"
                                       f"{_tail(Path(self.log.name))}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service="pie.v1.GenerateService"), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"server not ready in {timeout:.0f} s; its log ends:\n{_tail(Path(self.log.name))}")

    def close(self, wait: bool = True) -> None:
        """Ends the server: gracefully, or at once (`wait` False: the call is stopping)."""
        self.proc.terminate()
        _wait_or_kill(self.proc, 60 if wait else 0)
        self.log.close()


def served_round(address: str, work, rate: float | None, requests: int) -> dict:
    import asyncio

    from benchmarks.serving import poisson

    row = asyncio.run(poisson(address, work, rate, requests))
    row["itl_p99_over_p50"] = row["itl_p99_ms"] / row["itl_p50_ms"]
    return row


_T0 = time.perf_counter()


def _progress(name: str, r: int, label: str, figures: dict) -> None:
    """One round's figures as they come (a call cut short by its time limit still shows them), and
    the seconds since the script started (where a call's time goes)."""
    shown = ", ".join(f"{k} {v:,.4g}" for k, v in figures.items() if isinstance(v, (int, float)))
    print(f"  [{time.perf_counter() - _T0:.0f} s] {name} round {r + 1} {label}: {shown}", flush=True)


class Stopped(Exception):
    """SIGTERM: the call's time limit; the rounds measured so far are still tabled."""


def _stop(signum, frame) -> None:
    raise Stopped


def unit_of(name: str) -> tuple:
    """What a workload runs on: an offline engine of one page dtype and pool sizing, or `pie serve`.
    The workloads of one unit share each tree's engine or server (one start a tree, not one a
    workload: on the GPU a start is a model load, compiles and graph captures, ~30 s)."""
    if name in OFFLINE:
        kv, fixed_pool, _ = OFFLINE[name]
        return ("engine", kv, fixed_pool)
    return ("server",)


def groups(names: list[str]) -> list[list[str]]:
    """`names` grouped by unit, in the order each unit first appears."""
    by_unit: dict[tuple, list[str]] = {}
    for name in names:
        by_unit.setdefault(unit_of(name), []).append(name)
    return list(by_unit.values())


def served_requests(name: str, args) -> int:
    """A burst's streams are the long work's requests; Poisson arrivals last about
    --arrival-seconds (the rate times that many requests, at most the long work's)."""
    rate = SERVED[name]
    return args.requests if rate is None else min(args.requests, max(1, math.ceil(rate * args.arrival_seconds)))


def run_group(names: list[str], trees: dict[str, Arm], args, work, logs: Path,
              all_results: dict[str, dict[str, list[dict]]]) -> None:
    """`args.rounds` rounds of the workloads `names` (one unit) on every arm: each arm's engine or
    server starts once, then round after round every workload runs on every arm, the arms
    alternating (the order reversed every other round, so neither always goes first). Each
    round's figures are appended to all_results[name][arm] as they come, so a stop keeps the
    rounds already run."""
    from benchmarks.serving import for_level

    labels = list(trees)
    for name in names:
        all_results[name] = {label: [] for label in labels}
    units: dict[str, Worker | Server] = {}
    stopping = False
    try:
        for k, label in enumerate(labels, 1):
            # One after another: an engine sizes its pool from the device's free memory, so the
            # k-th takes k shares of it (the others' use counts against its fraction).
            t0 = time.perf_counter()
            log = logs / f"{names[0]}-{k}.log"
            if names[0] in OFFLINE:
                kv, fixed_pool, _ = OFFLINE[names[0]]
                spec = dict(model=args.model_dir, device=args.device, kv=kv,
                            kv_gib=args.kv_gib if fixed_pool else None, vocab=args.vocab,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            memory_fraction=k * args.memory_fraction, prompts=work.prompts, outs=work.max_tokens,
                            ttft_tokens=args.ttft_tokens, fields=trees[label].fields)
                worker = units[label] = Worker(trees[label].tree, spec, args.site, log)
                worker.read()  # ready
            else:
                server = units[label] = Server(trees[label].tree, args, args.site, log,
                                               memory_fraction=k * args.memory_fraction, fields=trees[label].fields)
                server.wait_ready()
            print(f"  {label}'s {'engine' if names[0] in OFFLINE else 'server'} for {', '.join(names)} "
                  f"up in {time.perf_counter() - t0:.0f} s", flush=True)
        for r in range(args.rounds):
            for i, name in enumerate(names):
                for label in labels if r % 2 == 0 else labels[::-1]:
                    unit = units[label]
                    if isinstance(unit, Worker):
                        figures = unit.run(OFFLINE[name][2])
                    else:
                        # A fresh draw of ids per round and workload: the server's prefix cache
                        # holds the prompts of the rounds before.
                        level = for_level(work, 1 + r * len(names) + i, args.vocab)
                        figures = served_round(unit.address, level, SERVED[name], served_requests(name, args))
                    all_results[name][label].append(figures)
                    _progress(name, r, label, figures)
    except Stopped:
        # The call's time limit: the engines and servers end at once, so that the table and --out
        # are written before whatever follows the SIGTERM.
        stopping = True
        raise
    finally:
        for unit in units.values():
            unit.close(wait=not stopping)


# What must agree for the rounds of an earlier call to stand in a table beside this call's.
RESUME_ARGS = ("shape", "device", "requests", "scale", "kv_gib", "ttft_tokens", "arrival_seconds", "rounds",
               "max_num_seqs", "max_num_batched_tokens", "memory_fraction")


def tree_fingerprint(tree: Path) -> str:
    """A hash of a tree's code (what the engines and servers run), the same wherever the tree is."""
    digest = hashlib.sha1()
    for top in ("engine", "kernels", "model", "service", "training", "protos", "clients/pie_client"):
        for path in sorted((tree / top).rglob("*")):
            if path.suffix in (".py", ".proto") and path.is_file():
                digest.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else device


def resumed(path: Path, trees: dict[str, Arm], args) -> dict[str, dict[str, list[dict]]]:
    """The workloads an earlier call's --out holds complete (every arm's rounds), where that call
    ran the same trees (by their code's fingerprint), on the same kind of device, with the same
    work: a full table can take several calls. ValueError says what differs."""
    earlier = json.loads(path.read_text())
    labels = list(earlier.get("trees", {}))
    if labels != list(trees):
        raise ValueError(f"its trees are {labels}, this call's {list(trees)}")
    for label, arm in trees.items():
        if earlier["trees"][label][1] != arm.fields:
            raise ValueError(f"{label}: its settings {earlier['trees'][label][1]}, this call's {arm.fields}")
        if earlier.get("fingerprints", {}).get(label) != tree_fingerprint(arm.tree):
            raise ValueError(f"{label}: its code differs from this call's (fingerprint "
                             f"{earlier.get('fingerprints', {}).get(label)} against {tree_fingerprint(arm.tree)})")
    if earlier.get("device") != device_name(args.device):
        raise ValueError(f"it ran on {earlier.get('device')}, this call on {device_name(args.device)}")
    for key in RESUME_ARGS:
        if earlier["args"].get(key) != getattr(args, key):
            raise ValueError(f"its {key} is {earlier['args'].get(key)!r}, this call's {getattr(args, key)!r}")
    return {name: rounds for name, rounds in earlier["results"].items()
            if name in MODES["full"] and all(len(rounds.get(label, [])) >= args.rounds for label in trees)}


def verdict(new: list[float], base: list[float], higher_better: bool) -> str:
    """REGRESSION: the new tree's best round is worse than the base's worst; better: the reverse."""
    best_new, worst_new = (max(new), min(new)) if higher_better else (min(new), max(new))
    best_base, worst_base = (max(base), min(base)) if higher_better else (min(base), max(base))
    worse = (lambda a, b: a < b) if higher_better else (lambda a, b: a > b)
    if worse(best_new, worst_base):
        return "REGRESSION"
    if worse(best_base, worst_new):
        return "better"
    return "same"


def table(all_results: dict[str, dict[str, list[dict]]], labels: list[str]) -> tuple[str, list[str]]:
    """The markdown table, and the REGRESSION lines."""
    new, bases = labels[0], labels[1:]
    head = ["workload", "figure"] + [f"{label} median (spread)" for label in labels]
    head += [f"{new} / {b}" for b in bases] + [f"verdict vs {b}" for b in bases]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    regressions = []
    for name, results in all_results.items():
        kind = OFFLINE[name][2] if name in OFFLINE else "served"
        for key, unit, higher in FIGURES[kind]:
            values = {label: [r[key] for r in results[label]] for label in labels}
            cells = [name, f"{key} ({unit}, {'higher' if higher else 'lower'} is better)"]
            for label in labels:
                v = values[label]
                cells.append(f"{statistics.median(v):,.4g} ({min(v):,.4g}-{max(v):,.4g})")
            ratios, verdicts = [], []
            for b in bases:
                ratios.append(f"{statistics.median(values[new]) / statistics.median(values[b]):.3f}")
                verdicts.append(verdict(values[new], values[b], higher))
                if verdicts[-1] == "REGRESSION":
                    regressions.append(f"REGRESSION: {name} {key}: {new} {statistics.median(values[new]):,.4g} "
                                       f"against {b} {statistics.median(values[b]):,.4g}")
            lines.append("| " + " | ".join(cells + ratios + verdicts) + " |")
    return "\n".join(lines), regressions


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(json.loads(Path(argv[1]).read_text()))
    from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser
    from benchmarks.serving import workload

    ap = make_parser(__doc__)
    ap.add_argument("--base", action="append", default=[],
                    help="a base tree to compare with, a folder; repeat for several (a --base or a --variant is needed)")
    ap.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                    help="this tree again with these EngineConfig fields set (module docstring); repeatable")
    ap.add_argument("--new", default=str(ROOT), help="the tree under test (default: this checkout)")
    ap.add_argument("--mode", choices=sorted(MODES), default="quick", help="which workloads (module docstring)")
    ap.add_argument("--workloads", default="", help="these workloads instead of --mode's, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each workload per tree, alternating")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and work (a smoke run of the same path)")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    sized = SizedFlags(ap)
    sized.add("--shape", "qwen2-7b", "tiny", "model shape", type=str, choices=sorted(SHAPES))
    sized.add("--requests", 256, 8, "requests of the long work (queued at once offline; a burst's streams)")
    sized.add("--scale", 1.0, 0.05, "multiplies every length of the long work", type=float)
    sized.add("--kv-gib", 8.0, 0.0025, "the fixed KV pool of the -8g workloads, GiB", type=float)
    sized.add("--ttft-tokens", 4096, 256, "the prompt of ttft-4k, tokens")
    sized.add("--arrival-seconds", 30.0, 3.0, "how long Poisson arrivals last (rate x this many requests, at most "
              "--requests)", type=float)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the batch cap, the same for every tree")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step, the same for every tree")
    ap.add_argument("--memory-fraction", type=float, default=None,
                    help="GPU share of each tree's engine or server, all trees' up at once (default: 0.45, "
                         "or 0.9 / the columns where more than two)")
    ap.add_argument("--model-dir", default=None, help="the model folder (default: built into a temporary folder)")
    ap.add_argument("--model-cache", default=None, metavar="DIR",
                    help="build the model into DIR/<shape> and keep it there for later calls (gpu.sh: "
                         "/tmp/pie-ab-models, so a held machine builds the 7B-class model once) (default: none)")
    ap.add_argument("--out", default=None, help="JSON file of every round's figures (default: none written)")
    ap.add_argument("--resume", default=None, metavar="JSON",
                    help="an earlier call's --out: its complete workloads are taken and tabled, those asked for that it "
                         "lacks run (the same trees, device and work, else it refuses); a full table over several "
                         "calls (default: none)")
    args = sized.fill(ap.parse_args(argv), "--tiny" in argv)
    args.device = args.device or default_device()
    args.site = str(ROOT / ".site") if (ROOT / ".site").is_dir() else None
    names = [w for w in args.workloads.split(",") if w] or MODES[args.mode]
    unknown = [w for w in names if w not in OFFLINE and w not in SERVED]
    if unknown:
        ap.error(f"unknown workloads {unknown}; known: {sorted(OFFLINE) + sorted(SERVED)}")
    if not args.base and not args.variant:
        ap.error("give a --base tree or a --variant to compare with")
    new_tree = Path(args.new).resolve()
    trees = {"new": Arm(new_tree, {})}
    for text in args.variant:
        try:
            fields = parse_variant(text)
            if "loras" not in fields or any(n in SERVED for n in names):
                server_flags(fields)  # (loras=N is refused here where a served workload runs)
        except ValueError as e:
            ap.error(str(e))
        trees["new+" + "+".join(f"{k}={v}" for k, v in fields.items())] = Arm(new_tree, fields)
    for base in args.base:
        path = Path(base).resolve()
        if not (path / "engine").is_dir():
            ap.error(f"--base {base}: no engine/ there (a tree of this project, e.g. git archive <commit>)")
        trees[path.name] = Arm(path, {})
    if args.memory_fraction is None:
        args.memory_fraction = min(0.45, 0.9 / len(trees))
    if len(trees) * args.memory_fraction > 1.0:  # every column's engine is up at once, the k-th asks k shares
        ap.error(f"{len(trees)} columns x --memory-fraction {args.memory_fraction} is more than the GPU: give "
                 f"--memory-fraction {0.9 / len(trees):.2f} or fewer --variant/--base (a 7B-class shape needs ~0.3 "
                 "of an 80 GB GPU: three columns at most)")
    _, fields = SHAPES[args.shape]
    args.vocab = min(fields["vocab_size"], 32000)  # prompt ids drawn from [3, vocab)
    all_results: dict[str, dict[str, list[dict]]] = {}
    if args.resume:
        try:
            all_results = resumed(Path(args.resume), trees, args)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--resume {args.resume}: {e}")
    with tempfile.TemporaryDirectory(prefix="pie-ab-") as tmp:
        logs = Path(tmp)  # each worker's and server's log; a failure prints the end of its own
        if args.model_dir is None:
            folder = Path(args.model_cache) / args.shape if args.model_cache else Path(tmp) / "model"
            args.model_dir = str(folder)
            if (folder / BUILT).exists():
                print(f"model {args.shape} taken from {folder}", flush=True)
            else:
                t0 = time.perf_counter()
                build_model(folder, args.shape, max_len=2048 if args.shape == "tiny" else 16384)
                (folder / BUILT).touch()  # last: a build cut short is built again
                print(f"model {args.shape} built in {time.perf_counter() - t0:.0f} s", flush=True)
        work = workload("long", args.requests, args.vocab, prompt_len=0, max_tokens=0, scale=args.scale)
        print("trees: " + ", ".join(f"{label} = {arm.tree}" for label, arm in trees.items()), flush=True)
        if args.resume:
            print(f"taken from {args.resume}: {', '.join(all_results) or 'nothing (no workload complete there)'}",
                  flush=True)
        todo = [n for n in names if n not in all_results]
        stopped = None
        signal.signal(signal.SIGTERM, _stop)
        try:
            for group in groups(todo):
                t0 = time.perf_counter()
                run_group(group, trees, args, work, logs, all_results)
                for name in group:
                    key = FIGURES[OFFLINE[name][2] if name in OFFLINE else "served"][0][0]
                    medians = ", ".join(f"{label} {statistics.median(r[key] for r in rounds):,.4g}"
                                        for label, rounds in all_results[name].items())
                    print(f"{name}: {args.rounds} rounds x {len(trees)} trees; {key} medians: {medians}", flush=True)
                print(f"{', '.join(group)}: {time.perf_counter() - t0:.0f} s, starts included", flush=True)
        except Stopped:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends it at once
            stopped = [n for n in todo  # not begun, or some tree short of its rounds
                       if not all_results.get(n) or any(len(r) < args.rounds for r in all_results[n].values())]
    # A workload is tabled where every tree has a round of it (a stop may leave them uneven).
    # The table and --out: this call's workloads and those taken from --resume, in the full table's order.
    shown = [n for n in MODES["full"] if n in names or n in all_results]
    done = {n: all_results[n] for n in shown if all_results.get(n) and all(all_results[n].values())}
    text, regressions = table(done, list(trees))
    print(f"\nA/B at the defaults, {args.shape}, {args.device}, {args.rounds} rounds "
          f"(max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens})\n")
    print(text)
    print("\n" + ("\n".join(regressions) if regressions else "verdict: no regression beyond the spreads"))
    if stopped is not None:
        print(f"STOPPED by SIGTERM: not every round ran of {', '.join(stopped)} (the table holds the rounds that did, "
              f"every tree's)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            trees={k: [str(arm.tree), arm.fields] for k, arm in trees.items()},
            fingerprints={k: tree_fingerprint(arm.tree) for k, arm in trees.items()}, device=device_name(args.device),
            results={n: all_results[n] for n in shown if n in all_results},
            args={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))}), indent=1))
    return 0 if stopped is None else 1


if __name__ == "__main__":
    sys.exit(main())
