"""A step is queued on the GPU without the host waiting for the device, except where it reads
the previous step back (an event: `PendingStep.result`, and the staging buffers' last copy).

Under async scheduling that is what keeps the GPU busy while the host reads step N-1 back and
prepares step N+1. One copy from pageable host memory breaks it: `torch.tensor(x, device="cuda")`,
`.to("cuda")` of a plain CPU tensor, or a CUDA tensor indexed with a Python list synchronizes the
stream, so the host waits for everything queued (the step before included) and the GPU then
idles while the host does its bookkeeping. Mixed steps (prompt tokens beside decodes) did that
when they picked their logits rows (`torch.tensor(rows, device=...)`).

- On the GPU, `torch.cuda.set_sync_debug_mode("error")` makes any implicit synchronization fail
  the step: served work of every kind (steady decodes from CUDA graphs, chunked prompts beside
  them, penalties, logit_bias and min_tokens, logprobs and prompt logprobs, n > 1, stop strings,
  an abort, n-gram speculation) runs with it on and must finish.
- Everywhere, a reading of engine/'s source finds none of the patterns that copy host data to the
  device synchronously; host data goes through `engine.device.to_device` (pinned, asynchronous).
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.messages import RequestStatus
from pie.engine.sampling_params import SamplingParams
from tests.helpers import make_hf_model_dir

ENGINE = Path(__file__).resolve().parents[3] / "engine"


def synchronous_copies(source: str) -> list[str]:
    """Calls in `source` that copy host data to a device synchronously: torch.tensor/as_tensor with
    a device, `.to(<device>)` or `.cuda()` without non_blocking=True, and `.pin_memory()` (pinning is
    `to_device`'s, the one place that gets it right)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        blocking = not (isinstance(kw.get("non_blocking"), ast.Constant) and kw["non_blocking"].value is True)
        to_device = (isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                     and ("device" in kw or (node.args and "device" in ast.unparse(node.args[0]).lower())))
        if ((func in ("torch.tensor", "torch.as_tensor") and "device" in kw)
                or (to_device and blocking)
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and blocking)
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "pin_memory")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def scalar_index_writes(source: str) -> list[str]:
    """Assignments `t[index] = <number or bool>` with an index that is neither a constant nor a
    slice (advanced indexing): on a CUDA tensor PyTorch makes the value a host scalar and copies
    it, synchronously (the H100's sync debug mode caught `seen[flat] = True` in the penalty table).
    `t.index_fill_(0, index, value)` passes the value as a kernel argument instead."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
            continue
        for target in node.targets:
            if isinstance(target, ast.Subscript) and not isinstance(target.slice, (ast.Constant, ast.Slice, ast.Tuple)):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_reading_finds_each_pattern():
    source = """
a = torch.tensor(rows, device=self.device)
b = torch.as_tensor(x, dtype=torch.int64, device=dev)
c = torch.from_numpy(index).to(self.device)
d = host.to(device=device)
e = x.cuda()
f = x.pin_memory()
ok1 = host.to(device, non_blocking=True)
ok2 = x.to(torch.int64)
ok3 = torch.zeros(4, device=device)
ok4 = torch.tensor(rows, dtype=torch.int64)
"""
    found = synchronous_copies(source)
    assert [f.split(":")[0] for f in found] == [f"line {n}" for n in range(2, 8)], found
    writes = """
seen[flat] = True
mask[rows] = 0.0
ok1 = x[0] = 0
drop[:, 0] = False
tables[:] = 0
seen.index_fill_(0, flat, True)
"""
    assert [f.split(":")[0] for f in scalar_index_writes(writes)] == ["line 2", "line 3"]


def test_engine_copies_host_data_only_through_to_device():
    offenders = {}
    for path in sorted(ENGINE.rglob("*.py")):
        found = synchronous_copies(path.read_text())
        if path.name == "device.py":  # to_device itself
            found = [f for f in found if not f.endswith(": host.pin_memory()")]
        if found:
            offenders[str(path.relative_to(ENGINE.parent))] = found
    assert not offenders, f"synchronous host-to-device copies (use engine.device.to_device): {offenders}"


def test_engine_writes_no_host_scalar_through_an_index_tensor():
    """engine/scheduling is left out: its bookkeeping (block lists, reference counts) is host-only."""
    offenders = {str(p.relative_to(ENGINE.parent)): found for p in sorted(ENGINE.rglob("*.py"))
                 if "scheduling" not in p.parts and (found := scalar_index_writes(p.read_text()))}
    assert not offenders, f"scalars written through an index (use index_fill_): {offenders}"


@pytest.mark.parametrize("speculative", [False, True])
def test_logits_positions_are_each_sampling_rows_last_tokens(rng, speculative):
    """The positions the runner reads logits at, found on the host (they replaced a device index
    built with a synchronous copy): each sampling row's last token in the step's packed tokens,
    and with proposals its newest token's and each proposal's. Rows that do not sample (a prompt
    chunk short of the prompt's end) read none."""
    from pie.engine.scheduling.step import ScheduledRequest, SchedulerOutput

    for _ in range(50):
        scheduled, flat = [], []  # flat: (row, index of the token in its row) per packed token
        for i in range(rng.randint(1, 12)):
            k = rng.randint(0, 4) if speculative and rng.random() < 0.5 else 0
            n = 1 + k if k else rng.choice([1, rng.randint(2, 40)])  # a decode (and its proposals), or a chunk
            sample = k > 0 or rng.random() < 0.7
            scheduled.append(ScheduledRequest(None, n, 0, sample, k))  # type: ignore[arg-type]
            flat += [(i, j) for j in range(n)]
        out = SchedulerOutput(scheduled=scheduled, num_spec_tokens=sum(s.num_spec for s in scheduled))
        rows = [i for i, s in enumerate(scheduled) if s.sample]
        want = [t for t, (i, j) in enumerate(flat)
                if scheduled[i].sample and j >= scheduled[i].num_new_tokens - 1 - scheduled[i].num_spec]
        got = out.logits_positions(rows)
        assert got.dtype == np.int64 and got.tolist() == want


def _workload(rng: random.Random, tag: str, vocab: int) -> tuple[list[tuple[int, str, list[int], SamplingParams]], str]:
    """(step to add it at, request id, prompt, params) of served work of every kind, and the id to abort."""
    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    seed = rng.randrange(2**31)
    work = [(0, f"{tag}-greedy{i}", prompt(rng.randrange(8, 40)), SamplingParams(max_tokens=48, temperature=0,
                                                                                 ignore_eos=True))
            for i in range(6)]
    work += [
        (3, f"{tag}-long", prompt(300), SamplingParams(max_tokens=24, temperature=0.8, seed=seed, ignore_eos=True)),
        (5, f"{tag}-penalties", prompt(60), SamplingParams(max_tokens=32, temperature=1.0, seed=seed + 1,
                                                           presence_penalty=0.5, frequency_penalty=0.3,
                                                           repetition_penalty=1.2, ignore_eos=True)),
        (7, f"{tag}-bias", prompt(20), SamplingParams(max_tokens=16, temperature=1.0, seed=seed + 2, min_tokens=8,
                                                      logit_bias={5: 2.0, 7: -50.0}, stop_token_ids=[9])),
        (9, f"{tag}-logprobs", prompt(90), SamplingParams(max_tokens=20, temperature=0.7, seed=seed + 3, logprobs=3,
                                                          prompt_logprobs=2, ignore_eos=True)),
        (11, f"{tag}-n3", prompt(50), SamplingParams(max_tokens=20, temperature=1.0, seed=seed + 4, n=3,
                                                     top_k=20, top_p=0.9, min_p=0.01, ignore_eos=True)),
        (13, f"{tag}-stop", prompt(30), SamplingParams(max_tokens=40, temperature=1.0, seed=seed + 5, stop=["e"])),
        (15, f"{tag}-aborted", prompt(200), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)),
        (17, f"{tag}-late", prompt(150), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
    ]
    return work, f"{tag}-aborted"


def _serve(engine: EngineCore, work, abort: str) -> dict[str, RequestStatus]:
    """Steps the engine through `work` (adding each request at its step, aborting `abort` a few
    steps after it came); returns the status of each sample that finished with an output."""
    status: dict[str, RequestStatus] = {}
    pending = sorted(work, key=lambda w: w[0])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, sp = pending.pop(0)
            engine.add_request(rid, prompt, sp)
        if step == 20:
            engine.abort(abort)
        for o in engine.step():
            if o.finished:
                assert o.status != RequestStatus.FINISHED_ERROR, f"{o.request_id}: {o.error}"
                status[f"{o.request_id}/{o.index}"] = o.status
        step += 1
        assert step < 5_000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    return status


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_steps_queue_without_host_syncs_on_gpu(tmp_path, rng, kv, speculative):
    model = make_hf_model_dir(tmp_path, "llama", seed=rng.randrange(2**31), weight_scale=4.0)
    engine = EngineCore(EngineConfig(model=str(model), device="cuda", dtype="bf16", kv_cache_dtype=kv,
                                     max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=256,
                                     speculative=speculative))
    assert engine._async and engine.runner.graphs, "async scheduling and CUDA graphs, as served"
    vocab = engine.vocab_size
    work, abort = _workload(rng, "warm", vocab)
    _serve(engine, work, abort)  # compiles every kernel and shape first (compiling may synchronize)
    work, abort = _workload(rng, "checked", vocab)
    prompt_tokens = engine.stats().step_prompt_tokens
    torch.cuda.set_sync_debug_mode("error")
    try:
        status = _serve(engine, work, abort)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.stats().step_prompt_tokens > prompt_tokens
    # every request ended with an answer, but the aborted one (an abort makes no output)
    assert set(status) == {f"{rid}/{i}" for _, rid, _, sp in work for i in range(sp.n) if rid != abort}
