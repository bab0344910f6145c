"""Speculative decoding's figures (issue 32): what a verify step costs, what it buys one stream and
a batch as a function of how many proposals are accepted, and what the n-gram proposer accepts on
copy-heavy prompts.

    python -m benchmarks.speculative                        # all three parts: GPU, Llama-1B shape, int8 pages
    python -m benchmarks.speculative --only cost,speed      # gpu.sh's `spec` suite
    python -m benchmarks.speculative --only ngram --device cpu   # (c) on the CPU
    python -m benchmarks.speculative --quick                # every code path, tiny, on the CPU (tests)

(a) cost: the time of one engine step whose rows each carry K proposals (K = 0: plain decoding),
    at batch sizes --cost-batches, on a random model of --shape: the wall time per step over
    --cost-steps steps once every request decodes (all K proposals accepted), and the device time
    of the step's forward pass and sampling or verification (CUDA events around the runner's
    launch; on the CPU, where the forward runs on the host, the wall time of that call).
(b) speed: decode tokens/s at batch sizes --speed-batches, greedy, --max-tokens out, against no
    speculation, when exactly a of K proposals are accepted in every verify step (a = 0..K, K in
    --speed-k). Speculation "forced" runs at any batch size; "default" keeps the engine's
    speculative_max_batch (nobody speculates in steps with more running decodes; run at batch sizes
    above it, a = min(3, K)): the two show where speculation stops paying.
(c) ngram: the n-gram (prompt lookup) proposer on the bundled model (model/bundled/stories-7m),
    one request at a time, on prompts that make copying likely: acceptance rate (accepted /
    proposed), mean accepted length (vLLM's definition: 1 + accepted / verify steps with
    proposals, the bonus token counted), tokens per decode step, decode tokens/s with and without
    it, and whether the outputs are those of plain decoding (greedy: every prompt; temperature > 0:
    the same seed draws the same tokens, engine/spec_decode/speculator.py).

Oracle proposals for (a) and (b): a plain greedy run first gives each request's continuation; the
proposer then proposes its next K tokens with all but the first a changed, and the verification's
verdict is forced to accept exactly a (`forced_acceptance`: the first a proposals, then the token
the row after them drew), so every verify step emits a + 1 tokens (fewer only where max_tokens
leaves fewer to propose) whatever the model computes. Forcing it is what makes the figure a
function of a alone: a random bf16 model's greedy tokens are near-ties, and on the H200 the verify
step's rounding (the extend kernel over 1 + K tokens, not the decode kernel) decided the first one
the other way in every run (2026-12-02: 0.05 accepted per step where 3 were proposed right). The
tokens of forced runs are therefore not plain decoding's; tests/engine/spec_decode/test_speculative.py checks
that the real verification's are. The engine has no public way to swap its proposer: the driver
below replaces the Speculator that EngineCore and its Scheduler hold, per run.

Decode tokens/s counts the tokens made after every request of the batch has its first one, over
the time since then. Each figure is the median of --repeats runs, with the spread (min-max).
Tables are printed as they fill; --out gets every figure as JSON, rewritten after each row, so a
run stopped by a timeout keeps what it measured (--budget-s stops starting new rows earlier).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser
from benchmarks.throughput import LLAMA_1B, LLAMA_4B, MICRO, TINY, build_model
from pie.engine.config import DEFAULT_MODEL, MODEL_DTYPES, EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.messages import RequestStatus
from pie.engine.runner.pending import PendingStep
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.request import Request
from pie.engine.scheduling.step import SchedulerOutput
from pie.engine.spec_decode.speculator import NgramProposer, Speculator
from pie.training.corpus import generate_stories

# Llama-3.1-8B's dimensions, its embeddings tied: a step's work is the same (the LM head is read
# either way), and a random model with tied embeddings repeats its last token by wide margins, so
# the oracle's continuations survive the verify step's rounding (an untied one's near-ties do not).
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=True)
SHAPES = {"llama-1b": LLAMA_1B, "4b": LLAMA_4B, "8b": LLAMA_8B, "tiny": TINY, "micro": MICRO}
PARTS = ("cost", "speed", "ngram")
BLOCK_SIZE = 16  # the engine's default page size, for sizing the pool
NGRAM_SEED = 3232  # the corpus stream of (c)'s stories (training used seed 0)
# (c)'s "edit" prompts: these words are changed in the given copy (and the hero's name, to NEW_NAME).
EDITS = {"big": "huge", "little": "tiny", "happy": "glad", "friend": "pal", "day": "morning"}
NEW_NAME, OTHER_NAME = "Zoe", "Max"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class OracleProposer:
    """Proposals from a known future (the module docstring): request `truth[id]` is its greedy
    continuation; proposal j is that continuation's next token j for j < `accepted`, and another
    token after, so a verify step accepts exactly `accepted` (the Proposer protocol of
    engine/spec_decode/speculator.py). `diverged`: requests whose output left their continuation."""

    method = "oracle"

    def __init__(self, accepted: int, vocab_size: int) -> None:
        self.accepted = accepted
        self.vocab_size = vocab_size
        self.truth: dict[str, list[int]] = {}  # request id -> its greedy continuation (a plain run's)
        self.diverged: set[str] = set()
        self._checked: dict[str, int] = {}  # request id -> output tokens compared with the truth so far

    def reserve(self, request: Request, k: int) -> int:
        rid, out = request.request_id, request.output_token_ids
        truth, m = self.truth[rid], len(out)
        seen = self._checked.get(rid, 0)
        if out[seen:m] != truth[seen:m]:
            self.diverged.add(rid)
        self._checked[rid] = m
        proposal = truth[m:m + k]
        for j in range(self.accepted, len(proposal)):
            proposal[j] = (proposal[j] + 1) % self.vocab_size  # not the argmax: rejected
        request.spec_token_ids = proposal
        return len(proposal)

    def propose(self, out: SchedulerOutput) -> None:
        return None  # set in reserve


@contextmanager
def forced_acceptance(accepted: int) -> Iterator[None]:
    """Verify steps accept exactly min(accepted, k) of a row's k proposals while this is open: the
    verdict read back from the device (PendingStep._verified's rows: token id, logprob,
    accepted, ...) is rewritten before the engine reads it. The step's device work is unchanged."""
    real = PendingStep._verified

    def forced(self: PendingStep, rows: list[list[float]]) -> list:
        at = 0
        for request, k in zip(self.requests, self._num_spec or []):
            a = min(accepted, k)
            for j in range(k + 1):
                rows[at + j][2] = 1.0 if j < a else 0.0
                if j < a:
                    rows[at + j][0] = float(request.spec_token_ids[j])
            at += k + 1
        return real(self, rows)

    PendingStep._verified = forced  # type: ignore[method-assign]
    try:
        yield
    finally:
        PendingStep._verified = real  # type: ignore[method-assign]


@dataclass(slots=True)
class Run:
    """One batch of requests run to the end."""

    outputs: list[list[int]]  # each request's tokens, in prompt order
    decode_tokens: int  # tokens made after every request had its first one
    decode_s: float  # the time since then
    decode_steps: int  # engine steps since then
    drafts: int = 0  # verify rows that carried proposals (SpecStats)
    draft_tokens: int = 0  # proposals verified
    accepted_tokens: int = 0  # of those, accepted
    diverged: int = 0  # oracle runs: requests whose tokens left their plain run's

    @property
    def tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Driver:
    """Runs requests through one engine, with speculation as asked: the engine's speculator is
    replaced per run (EngineCore and its Scheduler both hold it; None turns speculation off). The
    engine is built with speculation on, so that its runner is sized for the largest verify step."""

    def __init__(self, eng: EngineCore, device: str) -> None:
        self.eng = eng
        self.device = device
        self._minted = 0  # request ids made so far
        # Per runner.launch while `clocked`: (start, end) CUDA events, or seconds on the CPU.
        self.launches: list[Any] = []
        self.clocked = False
        self._launch = eng.runner.launch
        eng.runner.launch = self._timed_launch  # type: ignore[method-assign]

    def _timed_launch(self, *args: Any, **kwargs: Any) -> Any:
        if not self.clocked:
            return self._launch(*args, **kwargs)
        if self.device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = self._launch(*args, **kwargs)
            end.record()
            self.launches.append((start, end))
            return result
        t = time.perf_counter()
        result = self._launch(*args, **kwargs)
        self.launches.append(time.perf_counter() - t)
        return result

    def launch_ms(self) -> list[float]:
        """Each clocked launch's time in ms (after a synchronize)."""
        if self.device.startswith("cuda"):
            return [s.elapsed_time(e) for s, e in self.launches]
        return [1e3 * t for t in self.launches]

    def use(self, speculator: Speculator | None) -> None:
        self.eng.speculator = self.eng.scheduler.speculator = speculator

    def mint(self, n: int) -> list[str]:
        """n request ids not used before on this engine."""
        self._minted += n
        return [f"r{i}" for i in range(self._minted - n, self._minted)]

    def _start(self, prompts: list[list[int]], sp: SamplingParams, speculator: Speculator | None,
               truths: list[list[int]] | None) -> list[str]:
        eng = self.eng
        self.use(speculator)
        ids = self.mint(len(prompts))
        if truths is not None:
            assert speculator is not None and isinstance(speculator.proposer, OracleProposer)
            speculator.proposer.truth = dict(zip(ids, truths, strict=True))
        eng.block_manager.reset_prefix_cache()  # every run computes its prompts
        _sync(self.device)
        for rid, prompt in zip(ids, prompts):
            eng.add_request(rid, prompt, sp)
        return ids

    def _step(self) -> list:
        outs = self.eng.step()
        for o in outs:
            if o.status == RequestStatus.FINISHED_ERROR:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
        return outs

    def run(self, prompts: list[list[int]], sp: SamplingParams, speculator: Speculator | None = None,
            truths: list[list[int]] | None = None) -> Run:
        """The prompts as one batch, to the end. `truths`: the oracle's continuations (prompt order)."""
        ids = self._start(prompts, sp, speculator, truths)
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        no_token_yet = set(ids)
        t_first = None
        tokens = steps = 0
        while self.eng.has_unfinished():
            outs = self._step()
            if t_first is not None:
                steps += 1
            for o in outs:
                got[o.request_id] += o.new_token_ids
                if t_first is not None:
                    tokens += len(o.new_token_ids)
                elif o.new_token_ids:
                    no_token_yet.discard(o.request_id)
            if t_first is None and not no_token_yet:
                t_first = time.perf_counter()
        _sync(self.device)
        run = Run([got[rid] for rid in ids], tokens, time.perf_counter() - t_first if t_first else 0.0, steps)
        if speculator is not None:
            s = speculator.stats
            run.drafts, run.draft_tokens, run.accepted_tokens = s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens
            if isinstance(speculator.proposer, OracleProposer):
                run.diverged = len(speculator.proposer.diverged)
        return run

    def step_cost(self, prompts: list[list[int]], sp: SamplingParams, speculator: Speculator | None,
                  truths: list[list[int]] | None, warmup: int, steps: int) -> tuple[float, float]:
        """(wall ms per engine step, median ms of its launch) over `steps` steps, after `warmup`
        more, once every request decodes; then the requests are aborted. Raises if one finished
        inside the window (then the window measured fewer rows)."""
        eng = self.eng
        ids = self._start(prompts, sp, speculator, truths)
        no_token_yet = set(ids)
        while no_token_yet and eng.has_unfinished():
            for o in self._step():
                if o.new_token_ids:
                    no_token_yet.discard(o.request_id)
        for _ in range(warmup):
            self._step()
        _sync(self.device)
        self.launches.clear()
        self.clocked = True
        t0 = time.perf_counter()
        for _ in range(steps):
            self._step()
        _sync(self.device)
        wall = time.perf_counter() - t0
        self.clocked = False
        launches = self.launch_ms()
        running = eng.scheduler.num_running
        eng.abort_all()
        while eng.has_unfinished():
            eng.step()
        if running != len(prompts):
            raise RuntimeError(f"{len(prompts) - running} requests finished inside the timed steps")
        return 1e3 * wall / steps, statistics.median(launches)


class Results:
    """Every figure, written to --out as JSON after each row."""

    def __init__(self, path: str | None, meta: dict) -> None:
        self.path = path
        self.data: dict[str, Any] = dict(meta=meta, cost=[], speed=[], crossover=[], ngram=[], ngram_mismatches=[],
                                         skipped=[])

    def add(self, part: str, row: dict) -> None:
        self.data[part].append(row)
        self.save()

    def save(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=2))


class Budget:
    """--budget-s: no new row starts after this many seconds since the script started."""

    def __init__(self, seconds: float | None, results: Results) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.results = results

    def over(self, what: str) -> bool:
        if self.deadline is None or time.monotonic() < self.deadline:
            return False
        print(f"skipped (over --budget-s): {what}")
        self.results.add("skipped", dict(what=what))
        return True


# ---- (a) and (b): a random model, oracle proposals -------------------------------------------------
def cost_tokens(batch: int, k: int, args) -> int:
    """Output tokens a request needs so that none finishes inside (a)'s window at batch `batch`:
    the steps until the last prompt is in, the warm-up and timed steps, each making K + 1."""
    prefill_steps = -(-batch * args.prompt_len // args.max_batched_tokens) + 1
    return (prefill_steps + args.cost_warmup + args.cost_steps + 2) * (k + 1) + 1


def oracle(accepted: int, k: int, max_batch: int, vocab: int) -> Speculator:
    return Speculator(OracleProposer(accepted, vocab), k, max_batch)


def measure_cost(driver: Driver, batch: int, prompts, truths, args, results: Results, budget: Budget) -> None:
    vocab = driver.eng.vocab_size
    sp = SamplingParams(max_tokens=len(truths[0]), temperature=0, ignore_eos=True)
    base = None
    for k in range(args.cost_max_k + 1):
        if budget.over(f"cost batch {batch} K={k}"):
            continue
        walls, devices = [], []
        for _ in range(args.repeats):
            spec = oracle(k, k, batch, vocab) if k else None
            with forced_acceptance(k):
                wall, device = driver.step_cost(prompts, sp, spec, truths if k else None, args.cost_warmup,
                                                args.cost_steps)
            walls.append(wall)
            devices.append(device)
        row: dict[str, Any] = dict(batch=batch, k=k, step_ms=statistics.median(walls), step_ms_all=walls,
                                   launch_ms=statistics.median(devices), launch_ms_all=devices)
        if k == 0:
            base = row
        if base is not None:
            row["step_x_k0"] = row["step_ms"] / base["step_ms"]
            row["launch_x_k0"] = row["launch_ms"] / base["launch_ms"]
        results.add("cost", row)
        x, lx = row.get("step_x_k0"), row.get("launch_x_k0")
        print(f"| {batch} | {k} | {row['step_ms']:.3f} | {min(walls):.3f}-{max(walls):.3f} | "
              f"{'-' if x is None else f'{x:.2f}x'} | {row['launch_ms']:.3f} | {'-' if lx is None else f'{lx:.2f}x'} |",
              flush=True)


def accepted_values(k: int, spec: str) -> list[int]:
    return list(range(k + 1)) if spec == "all" else sorted({int(a) for a in spec.split(",") if int(a) <= k})


def measure_speed(driver: Driver, batch: int, prompts, truths, args, results: Results, budget: Budget) -> None:
    vocab = driver.eng.vocab_size
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    expected = [t[:args.max_tokens] for t in truths]
    default_max = EngineConfig().speculative_max_batch
    base: float | None = None
    plans: list[tuple[str, int, int]] = [("off", 0, 0)]  # (speculation, K, a)
    if batch > default_max:
        plans += [(f"default (max batch {default_max})", k, min(3, k)) for k in args.speed_k]
    plans += [("forced", k, a) for k in args.speed_k for a in accepted_values(k, args.accepted)]
    for mode, k, a in plans:
        if budget.over(f"speed batch {batch} {mode} K={k} a={a}"):
            continue
        runs = []
        for _ in range(args.repeats):
            if mode == "off":
                runs.append(driver.run(prompts, sp))
                continue
            with forced_acceptance(a):
                runs.append(driver.run(prompts, sp, oracle(a, k, batch if mode == "forced" else default_max, vocab),
                                       truths))
        rates = [r.tok_per_s for r in runs]
        med = statistics.median(rates)
        if mode == "off":
            base = med
        drafts = sum(r.drafts for r in runs)
        row = dict(batch=batch, speculation=mode, k=k, accepted=a,
                   accepted_per_step=sum(r.accepted_tokens for r in runs) / drafts if drafts else None,
                   verify_rows=drafts // len(runs), tok_per_s=med, tok_per_s_all=rates,
                   speedup=med / base if base else None,
                   # forced verdicts emit the proposals, not the model's tokens: only "off" compares
                   identical=sum(o == e for r in runs for o, e in zip(r.outputs, expected)) if mode == "off" else None,
                   requests=len(prompts) * len(runs), diverged=max(r.diverged for r in runs))
        results.add("speed", row)
        real = "-" if row["accepted_per_step"] is None else f"{row['accepted_per_step']:.2f}"
        sx = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        same = "-" if row["identical"] is None else f"{row['identical']}/{row['requests']}"
        print(f"| {batch} | {mode} | {k or '-'} | {a if k else '-'} | {real} | {med:,.0f} | "
              f"{min(rates):,.0f}-{max(rates):,.0f} | {sx} | {same} |", flush=True)


def crossover(rows: list[dict]) -> list[dict]:
    """Per (K, a) of the forced rows: the batch sizes where speculation pays and the smallest
    where it loses."""
    out = []
    for k, a in sorted({(r["k"], r["accepted"]) for r in rows if r["speculation"] == "forced"}):
        mine = sorted((r["batch"], r["speedup"]) for r in rows if r["speculation"] == "forced"
                      and (r["k"], r["accepted"]) == (k, a) and r["speedup"] is not None)
        loses = [b for b, x in mine if x < 1.0]
        out.append(dict(k=k, accepted=a, speedup_by_batch={str(b): x for b, x in mine},
                        loses_from_batch=loses[0] if loses else None))
    return out


def random_model_parts(args, results: Results, budget: Budget, parts: set[str]) -> None:
    shape = SHAPES[args.shape]
    cost_batches = args.cost_batches if "cost" in parts else []
    speed_batches = args.speed_batches if "speed" in parts else []
    max_batch = max(cost_batches + speed_batches)
    max_k = max(([args.cost_max_k] if cost_batches else []) + (args.speed_k if speed_batches else []))
    args.max_batched_tokens = max(2048, max_batch * (1 + max_k))

    def ref_tokens(batch: int) -> int:
        need = [args.max_tokens] if batch in speed_batches else []
        return max(need + ([cost_tokens(batch, args.cost_max_k, args)] if batch in cost_batches else []))

    longest = args.prompt_len + max(ref_tokens(b) for b in set(cost_batches + speed_batches))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(max_batch)]
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), shape, torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
                             made_by="pie")
        eng = EngineCore(EngineConfig(
            model=tmp, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv, block_size=BLOCK_SIZE,
            num_kv_blocks=max_batch * (-(-(longest + max_k + 1) // BLOCK_SIZE) + 1) + 64,
            max_num_seqs=max_batch, max_waiting=max(256, max_batch), max_num_batched_tokens=args.max_batched_tokens,
            max_model_len=longest + max_k + 8, speculative="ngram", num_speculative_tokens=max_k,
            speculative_max_batch=max_batch))
    results.data["meta"].update(shape=args.shape, params=params, dtype=eng.dtype_name, max_batch=max_batch,
                                max_num_batched_tokens=args.max_batched_tokens)
    print(f"# {args.device}: {args.shape}-shaped random Llama ({params / 1e6:,.1f}M params, {eng.dtype_name}), "
          f"{args.kv} pages; prompts of {args.prompt_len} random tokens; repeats {args.repeats}")
    driver = Driver(eng, args.device)
    vocab = eng.vocab_size
    # Warm-up: plain decoding and a verify step of each K on one request (kernels compiled, buffers touched).
    greedy = SamplingParams(max_tokens=4 * (max_k + 1) + 4, temperature=0, ignore_eos=True)
    truth = driver.run(prompts[:1], greedy).outputs
    for k in sorted(set(range(1, args.cost_max_k + 1) if cost_batches else []) | set(args.speed_k)):
        driver.run(prompts[:1], greedy, oracle(k, k, max_batch, vocab), truth)
    truths: dict[int, list[list[int]]] = {}

    def truths_for(batch: int) -> list[list[int]]:
        if batch not in truths:
            sp = SamplingParams(max_tokens=ref_tokens(batch), temperature=0, ignore_eos=True)
            truths[batch] = driver.run(prompts[:batch], sp).outputs
        return truths[batch]

    if cost_batches:
        print(f"\n## (a) cost: one engine step, every row with K proposals (all accepted); {args.cost_steps} steps "
              f"timed after {args.cost_warmup}")
        print("| batch | K | step ms (median) | spread | x K=0 | forward+sample/verify ms | x K=0 |")
        print("|---|---|---|---|---|---|---|")
        for batch in cost_batches:
            if not budget.over(f"reference run, batch {batch}"):
                measure_cost(driver, batch, prompts[:batch], truths_for(batch), args, results, budget)
    if speed_batches:
        print(f"\n## (b) speed: decode tok/s, greedy, {args.max_tokens} tokens out, a of K proposals accepted "
              f"per verify step")
        print("| batch | speculation | K | a | accepted/step (realized) | tok/s (median) | spread | x no speculation "
              "| outputs as plain |")
        print("|---|---|---|---|---|---|---|---|---|")
        for batch in speed_batches:
            if not budget.over(f"reference run, batch {batch}"):
                measure_speed(driver, batch, prompts[:batch], truths_for(batch), args, results, budget)
        summarize_speed(results)
    eng.close()


def summarize_speed(results: Results) -> None:
    rows = results.data["speed"]
    results.data["crossover"] = crossover(rows)
    results.save()
    rows = [r for r in rows if r["speedup"] is not None]  # (none where --budget-s skipped the plain run)
    for r in rows:
        if r["batch"] == 1 and r["speculation"] == "forced" and r["accepted"] == 3:
            print(f"one stream, 3 of {r['k']} accepted: {r['speedup']:.2f}x no speculation (issue 32: >= 1.8x)")
    for r in rows:
        if r["speculation"].startswith("default"):
            print(f"batch {r['batch']}, default speculative_max_batch, K={r['k']}: {r['speedup']:.2f}x "
                  f"no speculation (issue 32: no loss at 256)")
    for c in results.data["crossover"]:
        where = f"loses from batch {c['loses_from_batch']}" if c["loses_from_batch"] else "pays at every batch measured"
        speedups = ", ".join(f"{b}: {x:.2f}x" for b, x in c["speedup_by_batch"].items())
        print(f"forced, K={c['k']}, a={c['accepted']}: {where} ({speedups})")


# ---- (c): the n-gram proposer on the bundled model ---------------------------------------------------
def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?]) ", text, maxsplit=1)[0]


def edit(text: str) -> tuple[str, int]:
    """`text` with the hero's name and a few common words changed; returns it and the count changed."""
    swaps = dict(EDITS)
    hero = re.search(r"named (\w+)", text)
    if hero:
        swaps[hero.group(1)] = OTHER_NAME if hero.group(1) == NEW_NAME else NEW_NAME
    count = 0
    for old, new in swaps.items():
        text, n = re.subn(rf"\b{re.escape(old)}\b", new, text)
        count += n
    return text, count


def copy_prompts(eng: EngineCore, n: int, tokens: int) -> tuple[dict[str, list[list[int]]], float]:
    """Three kinds of prompt, n of each, from corpus stories the model was not trained on:
    "repeat": the story the model tells from a story's first sentence, then that sentence again;
    "edit": the same with a few words of the given copy changed (EDITS and the hero's name), so the
    copy is right but for those; "corpus": a corpus story itself (not the model's words, at most
    ~150 tokens), then its first sentence again. Returns them and the mean words changed per edit."""
    tok = eng.tokenizer
    stories = list(generate_stories(n, seed=NGRAM_SEED))
    openings = [first_sentence(s) for s in stories]
    told = eng.generate([tok.encode(o) for o in openings], SamplingParams(max_tokens=tokens, temperature=0))
    prompts: dict[str, list[list[int]]] = dict(repeat=[], edit=[], corpus=[])
    changed = []
    for story, opening, ids in zip(stories, openings, told):
        text = opening + tok.decode(ids)
        edited, count = edit(text)
        changed.append(count)
        prompts["repeat"].append(tok.encode(text + "\n\n" + opening))
        prompts["edit"].append(tok.encode(edited + "\n\n" + opening))
        paragraphs = story.split("\n\n")
        kept = paragraphs[:1]
        for p in paragraphs[1:]:
            if len(tok.encode("\n\n".join(kept + [p]))) > 150:
                break
            kept.append(p)
        prompts["corpus"].append(tok.encode("\n\n".join(kept) + "\n\n" + opening))
    return prompts, statistics.mean(changed)


def diagnose(driver: Driver, prompt: list[int], plain: list[int], spec: list[int]) -> dict:
    """Where a greedy run with n-gram proposals left the plain run: the first differing output
    position, and how far below the plain run's token the speculative run's was there (a plain run
    with top-5 logprobs), in nats: a near-tie is within the rounding of the verify step."""
    shorter = min(len(plain), len(spec))
    i = next((j for j in range(shorter) if plain[j] != spec[j]), shorter)
    eng = driver.eng
    driver.use(None)
    eng.add_request(driver.mint(1)[0], prompt, SamplingParams(max_tokens=i + 1, temperature=0, logprobs=5))
    logprobs = []
    while eng.has_unfinished():
        for o in driver._step():
            logprobs += o.new_logprobs
    row: dict[str, Any] = dict(position=i, plain_len=len(plain), spec_len=len(spec))
    if i < shorter and i < len(logprobs):
        top = dict(logprobs[i].top)
        row.update(plain_token=plain[i], spec_token=spec[i],
                   margin_nats=top[plain[i]] - top[spec[i]] if spec[i] in top and plain[i] in top else None)
    return row


def ngram_part(args, results: Results, budget: Budget) -> None:
    eng = EngineCore(EngineConfig(model=DEFAULT_MODEL, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv,
                                  speculative="ngram", num_speculative_tokens=args.ngram_k))
    cfg = eng.config
    driver = Driver(eng, args.device)
    driver.use(None)
    prompts, changed = copy_prompts(eng, args.ngram_prompts, args.ngram_tokens)
    lengths = [len(p) for ps in prompts.values() for p in ps]
    results.data["meta"].update(
        ngram_model=DEFAULT_MODEL, ngram_dtype=eng.dtype_name, ngram_k=args.ngram_k,
        prompt_lookup=[cfg.prompt_lookup_min, cfg.prompt_lookup_max], ngram_words_edited=changed,
        ngram_prompt_tokens={kind: [min(map(len, ps)), max(map(len, ps))] for kind, ps in prompts.items()})
    print(f"\n## (c) n-gram proposals (K={args.ngram_k}, lookup {cfg.prompt_lookup_max}..{cfg.prompt_lookup_min} "
          f"tokens), bundled model, {eng.dtype_name} weights, {args.kv} pages, one request at a time; "
          f"{args.ngram_prompts} prompts of each kind ({min(lengths)}-{max(lengths)} tokens), "
          f"up to {args.ngram_tokens} tokens out; edits change {changed:.1f} words per prompt")
    print("| prompts | temperature | acceptance rate | mean accepted length | tokens/step | tok/s n-gram (median) "
          "| spread | tok/s plain (median) | spread | speed-up | outputs as plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def ngram() -> Speculator:
        return Speculator(NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max), args.ngram_k,
                          cfg.speculative_max_batch)

    # Warm-up, untimed: the first kind's prompts with and without proposals (a process's first
    # seconds of runs are ~20% slower on the CPU: measured 95 against 120 tok/s on 2 cores).
    for prompt in prompts["repeat"]:
        for spec in (None, ngram()):
            driver.run([prompt], SamplingParams(max_tokens=args.ngram_tokens, temperature=0), spec)
    for kind, kind_prompts in prompts.items():
        for temperature in args.temperatures:
            if budget.over(f"ngram {kind} temperature {temperature}"):
                continue
            per_repeat = []
            same = total = 0
            for r in range(args.repeats):
                plain_runs, spec_runs = [], []
                for i, prompt in enumerate(kind_prompts):
                    sp = SamplingParams(max_tokens=args.ngram_tokens, temperature=temperature, seed=1000 * r + i)
                    plain_runs.append(driver.run([prompt], sp))
                    spec_runs.append(driver.run([prompt], sp, ngram()))
                    equal = plain_runs[-1].outputs == spec_runs[-1].outputs
                    same, total = same + equal, total + 1
                    if not equal and r == 0 and temperature == 0:
                        d = diagnose(driver, prompt, plain_runs[-1].outputs[0], spec_runs[-1].outputs[0])
                        results.add("ngram_mismatches", dict(kind=kind, prompt=i, **d))
                per_repeat.append(_ngram_figures(plain_runs, spec_runs))
            row = dict(kind=kind, temperature=temperature, identical=same, runs=total)
            for key in per_repeat[0]:
                values = [f[key] for f in per_repeat]
                row[key] = statistics.median(values)
                row[f"{key}_all"] = values
            row["speedup"] = row["ngram_tok_per_s"] / row["plain_tok_per_s"]
            results.add("ngram", row)
            print(f"| {kind} | {temperature:g} | {row['acceptance_rate']:.2f} | {row['mean_accepted_length']:.2f} | "
                  f"{row['tokens_per_step']:.2f} | {row['ngram_tok_per_s']:,.0f} | "
                  f"{_fmt_spread(row['ngram_tok_per_s_all'])} | {row['plain_tok_per_s']:,.0f} | "
                  f"{_fmt_spread(row['plain_tok_per_s_all'])} | {row['speedup']:.2f}x | {same}/{total} |", flush=True)
    for m in results.data["ngram_mismatches"]:
        margin = "not both in the top 5" if m.get("margin_nats") is None else f"{m['margin_nats']:.2g} nats below"
        print(f"greedy {m['kind']} prompt {m['prompt']}: left the plain run at output {m['position']} "
              f"(the speculative run's token {margin} the plain run's there)")
    eng.close()


def _ngram_figures(plain: list[Run], spec: list[Run]) -> dict[str, float]:
    """One repeat's figures over a kind's prompts (sums over its requests)."""
    drafts = sum(r.drafts for r in spec)
    accepted = sum(r.accepted_tokens for r in spec)
    proposed = sum(r.draft_tokens for r in spec)
    return dict(acceptance_rate=accepted / proposed if proposed else 0.0,
                mean_accepted_length=1 + accepted / drafts if drafts else 1.0,
                tokens_per_step=sum(r.decode_tokens for r in spec) / max(1, sum(r.decode_steps for r in spec)),
                ngram_tok_per_s=sum(r.decode_tokens for r in spec) / sum(r.decode_s for r in spec),
                plain_tok_per_s=sum(r.decode_tokens for r in plain) / sum(r.decode_s for r in plain))


def _fmt_spread(values: list[float]) -> str:
    return f"{min(values):,.0f}-{max(values):,.0f}"


# ---- flags and main --------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="a tiny run of every code path on the CPU (the micro shape, small batches, few tokens)")
    ap.add_argument("--device", default=None, help=DEVICE_HELP + "; cpu with --quick")
    ap.add_argument("--only", default=",".join(PARTS), help=f"parts to run, comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="random model of (a) and (b) (default: llama-1b on CUDA, tiny on the CPU, micro with --quick)")
    ap.add_argument("--kv", default="int8", help="KV cache dtype (pages) of every engine")
    ap.add_argument("--dtype", default="auto", choices=MODEL_DTYPES,
                    help="weights and activations of every engine (auto: the engine's choice; bf16 on CUDA)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported with the spread")
    sized = SizedFlags(ap, switch="--quick")
    sized.add("--cost-batches", [1, 8, 64], [1, 3], "(a): batch sizes, comma-separated", type=_ints,
              shown=("1,8,64", "1,3"))
    sized.add("--cost-max-k", 8, 2, "(a): proposals per row, 0 (plain decoding) to this")
    sized.add("--cost-steps", 20, 3, "(a): engine steps timed per run")
    sized.add("--cost-warmup", 4, 1, "(a): engine steps run before the timed ones, once every request decodes")
    sized.add("--speed-batches", [1, 8, 64, 256], [1, 12], "(b): batch sizes, comma-separated", type=_ints,
              shown=("1,8,64,256", "1,12"))
    sized.add("--speed-k", [4, 8], [2], "(b): proposals per verify step, comma-separated", type=_ints,
              shown=("4,8", "2"))
    ap.add_argument("--accepted", default="all",
                    help="(b): proposals accepted per verify step, comma-separated (those above K are left out), "
                         "or all: 0..K")
    sized.add("--prompt-len", 128, 16, "(a), (b): prompt tokens (random ids)")
    sized.add("--max-tokens", 256, 24, "(b): tokens generated per request")
    sized.add("--ngram-prompts", 6, 1, "(c): prompts of each kind")
    sized.add("--ngram-tokens", 96, 24, "(c): tokens generated per request at most (EOS may end it sooner)")
    ap.add_argument("--ngram-k", type=int, default=4, help="(c): n-gram proposals per step at most (the engine's default)")
    ap.add_argument("--temperatures", type=_floats, default=[0.0, 0.8],
                    help="(c): sampling temperatures, comma-separated (default: 0,0.8; 0 is greedy)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new row after this many seconds (default: no limit, every row runs)")
    ap.add_argument("--out", default=None, help="JSON file for every figure (default: none written)")
    args = ap.parse_args(argv)
    sized.fill(args, args.quick)
    parts = set(args.only.split(","))
    if not parts or parts - set(PARTS):
        ap.error(f"--only: parts are {', '.join(PARTS)}, got {args.only!r}")
    if args.repeats < 1 or args.cost_max_k < 1 or min(args.speed_k) < 1 or args.cost_steps < 1:
        ap.error("--repeats, --cost-max-k, --speed-k and --cost-steps must be >= 1")
    if args.accepted != "all" and not re.fullmatch(r"\d+(,\d+)*", args.accepted):
        ap.error(f"--accepted: all, or numbers separated by commas, got {args.accepted!r}")
    args.device = args.device or ("cpu" if args.quick else default_device())
    args.shape = args.shape or ("micro" if args.quick else "llama-1b" if args.device.startswith("cuda") else "tiny")
    meta = dict(device=args.device, device_name=torch.cuda.get_device_name(args.device) if args.device.startswith(
        "cuda") else "cpu", torch=torch.__version__, commit=_commit(), kv=args.kv, repeats=args.repeats,
        prompt_len=args.prompt_len, max_tokens=args.max_tokens, command=" ".join(sys.argv), args=dict(vars(args)))
    results = Results(args.out, meta)
    budget = Budget(args.budget_s, results)
    if parts & {"cost", "speed"}:
        random_model_parts(args, results, budget, parts)
    if "ngram" in parts:
        ngram_part(args, results, budget)
    results.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
