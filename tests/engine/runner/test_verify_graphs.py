"""CUDA graphs for speculative decoding's verify steps (engine/runner/cuda_graphs.py; the strided layout
of `StepStager.stage_verify`).

On the CPU: the strided layout against the packed layout of the eager step (ids, positions, slots,
lengths, query starts, the logits rows kept, the block tables), which steps a verify graph takes,
and a verify step through the runner's graph path with the forward pass a verify graph captures
run eagerly over the views of the staging buffers' device copies it reads (the torch reference
path, and the Triton kernels in the interpreter), against the eager verify step. On a GPU: a
graphed verify step against the eager one (int8 and bf16 pages, batches 1, 3 and 8 with k = 0..K
proposals per row, rows at block boundaries, a model with a sliding window in one layer), and
greedy speculative decoding against plain decoding, graphs on in both.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.runner.cuda_graphs import CudaGraphs, Graph, graph_buckets, graph_inputs
from pie.engine.runner.kv_cache import KVCache
from pie.engine.runner.model_runner import ModelRunner
from pie.engine.runner.pending import StepLogits
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.request import Request
from pie.engine.scheduling.step import ScheduledRequest, SchedulerOutput
from tests.engine.sample.test_seed_consistency import Run
from tests.engine.spec_decode.test_speculative import _prompts
from tests.helpers import make_hf_model_dir

K = 4  # proposals per row at most: verify rows are 1 + K tokens wide
VOCAB = 512  # the tiny models' (tests/helpers.py)


# ---- the strided layout, on the CPU ------------------------------------------------------------

def _staging_runner(block_size: int, max_model_len: int) -> ModelRunner:
    cache = KVCache(num_layers=1, num_blocks=128, block_size=block_size, num_kv_heads=1, head_dim=8,
                    kv_cache_dtype="fp32", device=torch.device("cpu"))
    return ModelRunner(torch.nn.Identity(), cache, vocab_size=32, softmax_scale=1.0, device=torch.device("cpu"),
                       max_num_seqs=8, max_num_batched_tokens=16, max_model_len=max_model_len,
                       max_spec_tokens=8 * K, spec_tokens_per_row=K)


def _verify_row(rng: random.Random, start: int, k: int, block_size: int, max_model_len: int) -> ScheduledRequest:
    """A decode of the token at `start` with k proposals, its blocks (shuffled ids) allocated."""
    req = Request(f"r{rng.random()}", [rng.randrange(3, 32) for _ in range(start + 1)], SamplingParams(),
                  max_model_len=max_model_len)
    req.num_computed_tokens = start
    req.spec_token_ids = [rng.randrange(3, 32) for _ in range(k)]
    req.block_ids = rng.sample(range(128), -(-(start + 1 + k) // block_size))
    return ScheduledRequest(req, 1 + k, start, True, k)


def _packed_logits_index(out: SchedulerOutput) -> np.ndarray:
    """The logits rows of the eager verify step (ModelRunner.forward_logits, packed layout)."""
    ends = np.cumsum([s.num_new_tokens for s in out.scheduled])
    return np.concatenate([np.arange(ends[i] - 1 - s.num_spec, ends[i]) for i, s in enumerate(out.scheduled)])


@pytest.mark.parametrize("block_size", [4, 16])
def test_strided_staging_is_the_packed_layout_with_padding(rng, block_size):
    """Every row's tokens (ids, positions, slots) at [i W, i W + 1 + k) are the packed layout's, the
    rest padding (id 0, position 0, slot -1); lengths end the W queries where the row's real ones
    end; the logits index picks the tokens the eager step's index picks; the tables cover every key
    position below start + W, zero past the row's blocks; the facts send every row through the
    extend kernel. Rows at block boundaries, at the context's end, k = 0 included."""
    max_model_len = 64
    runner = _staging_runner(block_size, max_model_len)
    stager, w = runner.stager, 1 + K
    for _ in range(30):
        b = rng.randint(1, 8)
        ks = [rng.randint(0, K) for _ in range(b)]
        if b > 1:
            ks[rng.randrange(b)], ks[rng.randrange(b)] = 0, K
        rows = []
        for k in ks:
            last = max_model_len - 1 if k == 0 else max_model_len - 2 - k  # the scheduler's caps
            edge = rng.randrange(1, last // block_size + 1) * block_size  # a block boundary
            start = rng.choice([rng.randint(1, last), min(last, edge - rng.randint(0, 2)), last])
            rows.append(_verify_row(rng, start, k, block_size, max_model_len))
        out = SchedulerOutput(scheduled=rows, num_batched_tokens=sum(1 + k for k in ks), num_spec_tokens=sum(ks))
        tables = [s.request.block_ids for s in rows]
        packed = stager.stage(out, tables, None, None, proposals=True)
        p_ids, p_pos = packed.input_ids.tolist(), packed.positions.tolist()
        p_slots, p_lens = packed.metadata.slot_mapping.tolist(), packed.metadata.seq_lens.tolist()
        p_qsl = packed.metadata.query_start_loc.tolist()
        bucket = next(g for g in graph_buckets(8) if g >= b)

        step = stager.stage_verify(out, tables, bucket, w)
        md = step.metadata
        ids, pos, slots = step.input_ids.tolist(), step.positions.tolist(), md.slot_mapping.tolist()
        assert len(ids) == len(pos) == len(slots) == bucket * w
        assert (step.num_seqs, step.graph_batch) == (b, bucket)
        for i, (s, k) in enumerate(zip(rows, ks)):
            real, pad = slice(i * w, i * w + 1 + k), slice(i * w + 1 + k, (i + 1) * w)
            lo, hi = p_qsl[i], p_qsl[i + 1]
            assert (ids[real], pos[real], slots[real]) == (p_ids[lo:hi], p_pos[lo:hi], p_slots[lo:hi])
            assert pos[real] == list(range(s.start, s.start + 1 + k))
            assert ids[real] == s.request.all_token_ids[s.start:] + s.request.spec_token_ids
            assert (ids[pad], pos[pad], slots[pad]) == ([0] * (K - k), [0] * (K - k), [-1] * (K - k))
        assert ids[b * w:] == [0] * ((bucket - b) * w) and slots[b * w:] == [-1] * ((bucket - b) * w)
        lens = md.seq_lens.tolist()
        assert lens[:b] == [n + K - k for n, k in zip(p_lens, ks)] and lens[b:] == [w] * (bucket - b)
        assert md.query_start_loc.tolist() == list(range(0, bucket * w + 1, w))
        assert (md.max_query_len, md.num_decodes, md.prefill_query_start_loc) == (w, 0, None)
        assert md.max_seq_len == max(lens)

        assert step.logits_index is not None
        index, want = step.logits_index.tolist(), _packed_logits_index(out)
        assert index == [i * w + j for i, k in enumerate(ks) for j in range(1 + k)]
        assert [ids[t] for t in index] == [p_ids[t] for t in want]
        assert [pos[t] for t in index] == [p_pos[t] for t in want]
        assert [slots[t] for t in index] == [p_slots[t] for t in want]

        bt = md.block_tables
        assert bt.shape[0] == bucket and bt.shape[1] >= -(-max(lens) // block_size)
        for i, s in enumerate(rows):
            n = len(s.request.block_ids)
            assert bt[i, :n].tolist() == s.request.block_ids and not bt[i, n:].any()
        assert not bt[b:].any()
        assert stager.prev is None  # the buffers no longer hold a decode step's inputs

        # A decode step staged afterwards sees only its own values (as a fresh stager stages it).
        decode = [_verify_row(rng, rng.randint(1, max_model_len - 1), 0, block_size, max_model_len)
                  for _ in range(rng.randint(1, 8))]
        dec_out = SchedulerOutput(scheduled=decode, num_batched_tokens=len(decode))
        d_tables = [s.request.block_ids for s in decode]
        for graph_batch in (None, 8):
            got = stager.stage(dec_out, d_tables, graph_batch, None)
            want_step = _staging_runner(block_size, max_model_len).stager.stage(dec_out, d_tables, graph_batch, None)
            for a, c in ((got.input_ids, want_step.input_ids), (got.positions, want_step.positions),
                         (got.metadata.slot_mapping, want_step.metadata.slot_mapping),
                         (got.metadata.seq_lens, want_step.metadata.seq_lens),
                         (got.metadata.query_start_loc, want_step.metadata.query_start_loc),
                         (got.metadata.block_tables, want_step.metadata.block_tables)):
                assert a.tolist() == c.tolist()


def test_strided_staging_refuses_rows_it_cannot_hold(rng):
    runner = _staging_runner(4, 64)
    row = _verify_row(rng, 9, 2, 4, 64)
    out = SchedulerOutput(scheduled=[row], num_batched_tokens=3, num_spec_tokens=2)
    row.request.num_output_placeholders = 1  # a newest id still on the device
    with pytest.raises(AssertionError, match="not read back"):
        runner.stager.stage_verify(out, [row.request.block_ids], 1, 1 + K)
    row.request.num_output_placeholders = 0
    with pytest.raises(AssertionError, match="not a decode"):
        runner.stager.stage_verify(out, [row.request.block_ids], 1, 2)  # 3 tokens in rows of 2
    chunk = ScheduledRequest(row.request, 3, 7, False)  # a prompt chunk that does not sample
    with pytest.raises(AssertionError, match="not a decode"):
        runner.stager.stage_verify(SchedulerOutput(scheduled=[chunk], num_batched_tokens=3), [row.request.block_ids],
                                   1, 1 + K)


def test_a_verify_graph_takes_steps_of_decodes_only(rng):
    graphs = CudaGraphs()
    graphs.verify = {b: Graph.__new__(Graph) for b in graph_buckets(8)}
    graphs.verify_width = 1 + K

    def step(*rows: ScheduledRequest) -> SchedulerOutput:
        return SchedulerOutput(scheduled=list(rows), num_batched_tokens=sum(s.num_new_tokens for s in rows),
                               num_spec_tokens=sum(s.num_spec for s in rows))

    def row(k: int) -> ScheduledRequest:
        return _verify_row(rng, rng.randint(1, 40), k, 4, 64)

    assert graphs.verify_bucket_for(step(row(2))) == 1
    assert graphs.verify_bucket_for(step(row(0), row(K), row(1))) == 4  # k = 0 rows too
    assert graphs.verify_bucket_for(step(*[row(1) for _ in range(8)])) == 8
    assert graphs.verify_bucket_for(step(*[row(1) for _ in range(9)])) is None  # beyond the largest bucket
    assert graphs.verify_bucket_for(step(row(0), row(0))) is None  # no proposals: a decode graph's step
    prompt = ScheduledRequest(row(0).request, 6, 0, True)  # a whole prompt beside the decodes
    assert graphs.verify_bucket_for(step(row(2), prompt)) is None
    middle = ScheduledRequest(row(0).request, 1, 3, False)  # one token of a prompt, sampling nothing
    assert graphs.verify_bucket_for(step(row(2), middle)) is None
    assert CudaGraphs().verify_bucket_for(step(row(2))) is None  # none captured


# ---- a verify step, graphed and eager -------------------------------------------------------------

class PlannedProposer:
    """Proposals by plan: request id -> how many (random ids); none for other requests."""

    method = "planned"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.plan: dict[str, int] = {}

    def reserve(self, request: Request, k: int) -> int:
        n = min(k, self.plan.get(request.request_id, 0))
        request.spec_token_ids = [self.rng.randrange(3, VOCAB) for _ in range(n)]
        return n

    def propose(self, out: SchedulerOutput) -> None:
        return None


def _verify_step(model_dir, rng: random.Random, starts: list[int], ks: list[int],
                 **kw) -> tuple[EngineCore, SchedulerOutput]:
    """An engine whose next step verifies ks[i] proposals of request i, whose newest token sits at
    position starts[i] (its prompt of starts[i] - 1 tokens, then one token decoded)."""
    cfg = dict(model=str(model_dir), block_size=16, num_kv_blocks=256, max_num_seqs=8, async_scheduling=False,
               speculative="ngram", num_speculative_tokens=K)
    engine = EngineCore(EngineConfig(**{**cfg, **kw}))
    assert engine.speculator is not None
    proposer = PlannedProposer(rng)
    engine.speculator.proposer = proposer
    for i, start in enumerate(starts):
        engine.add_request(f"v{i}", [rng.randrange(3, VOCAB) for _ in range(start - 1)],
                           SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompts
    engine.step()  # one decode each
    proposer.plan = {f"v{i}": k for i, k in enumerate(ks)}
    out = engine.scheduler.schedule()
    got = {s.request.request_id: (s.start, s.num_spec, s.num_new_tokens) for s in out.scheduled}
    assert got == {f"v{i}": (start, k, 1 + k) for i, (start, k) in enumerate(zip(starts, ks))}
    return engine, out


class _NoEvent:
    """The staging copy's CUDA event, on the CPU: nothing to wait for."""

    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass


def _emulate_graphs(runner: ModelRunner, rng: random.Random) -> list[int]:
    """Gives the runner on the CPU what it has on CUDA: staging buffers with device copies apart
    from the host ones (the tables' whole-width rows holding stale block ids), and verify "graphs"
    that run what the captured ones run, eagerly: `graph_forward` over the views of those copies
    a graph of the bucket reads (`graph_inputs`). Returns the buckets replayed, as they are."""
    st = runner.stager
    st.dev_ints = torch.zeros_like(st.host_ints)
    cols = st.host_tables.numel() // runner.max_num_seqs
    st.dev_tables = torch.tensor([[rng.randrange(runner.kv_cache.num_blocks) for _ in range(cols)]
                                  for _ in range(runner.max_num_seqs)], dtype=torch.int32)
    st._copied = _NoEvent()
    st.prev = None
    graphs, width = runner.graphs, 1 + runner.spec_tokens_per_row
    graphs.verify = {b: Graph.__new__(Graph) for b in graph_buckets(runner.verify_rows)}
    graphs.verify_width = width
    replays: list[int] = []

    def replay(bucket: int) -> torch.Tensor:
        replays.append(bucket)
        metadata, ids, positions = graph_inputs(st, bucket, width, runner.max_model_len)
        runner.attention.metadata = metadata
        try:
            return runner.graph_forward(ids, positions)
        finally:
            runner.attention.metadata = None

    graphs.replay_verify = replay
    return replays


WINDOW = dict(sliding_window=9, use_sliding_window=True, max_window_layers=1)  # layer 1 windowed, layer 0 not
# Newest tokens at block boundaries (block 16) and k = 0..K, a k = 0 row first (the eager step's
# mixed decode-then-extend split): a row's proposals crossing into its next block, a k = 0 row
# whose padding reaches into a block it does not hold.
CASES = {
    1: ([14], [3]),
    3: ([30, 15, 47], [0, 4, 2]),
    5: ([30, 15, 47, 16, 12], [0, 4, 2, 1, 4]),
    8: ([30, 15, 47, 16, 12, 33, 62, 31], [0, 4, 2, 1, 4, 0, 3, 4]),
}
CPU_CASES = {  # (attention backend, KV dtype, model overrides)
    "torch-fp32": ("torch", "fp32", {}),
    "torch-int8": ("torch", "int8", {}),
    "torch-bf16-window": ("torch", "bf16", WINDOW),
    "triton-fp32": ("triton", "fp32", {}),  # new keys from the step's tensors (k_new)
    "triton-int8-window": ("triton", "int8", WINDOW),  # every key from the pages
}
CPU_TOL = {"fp32": 1e-4, "bf16": 4e-3, "int8": 1e-2}  # test_seed_consistency's later-token tolerances


@pytest.mark.parametrize("case", CPU_CASES)
def test_a_verify_step_through_its_graphs_inputs_gives_the_eager_logits_on_the_cpu(rng, tmp_path, case):
    """`forward_logits` of a verify step (5 rows: bucket 8) through a verify "graph" that runs what
    the captured one runs over the views it reads (`_emulate_graphs`): the eager verify step's
    logits row for row, and the same verified tokens."""
    backend, kv, overrides = CPU_CASES[case]
    starts, ks = CASES[5]
    model_dir = make_hf_model_dir(tmp_path, "qwen2" if overrides else "llama", weight_scale=4.0, **overrides)
    engine, out = _verify_step(model_dir, rng, starts, ks, device="cpu", dtype="fp32", kv_cache_dtype=kv,
                               attention_backend=backend)
    runner = engine.runner
    assert not runner.graphs and runner.verify_rows == 8 and runner.spec_tokens_per_row == K
    assert runner.attention.windows == ([None, 9] if overrides else [None, None])
    replays = _emulate_graphs(runner, rng)
    assert runner.graphs.verify_bucket_for(out) == 8
    rows_g, graphed = runner.forward_logits(out)
    assert replays == [8]
    rows_e, eager = runner.forward_logits(out, eager=True)
    assert replays == [8] and graphed is not None and eager is not None
    assert rows_g == rows_e == list(range(5))
    assert graphed.shape == eager.shape == (sum(1 + k for k in ks), VOCAB)
    torch.testing.assert_close(graphed, eager, rtol=0, atol=CPU_TOL[kv])
    _assert_same_choices(graphed, eager)
    if bool((graphed.argmax(-1) == eager.argmax(-1)).all()):
        assert _verified(runner, out, rows_g, graphed) == _verified(runner, out, rows_e, eager)


def _assert_same_choices(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same argmax in every row, or a near-tie in `want` there (within twice the rows'
    largest difference)."""
    diff = float((got - want).abs().max())
    a, b = want.argmax(-1), got.argmax(-1)
    for r in (a != b).nonzero().flatten().tolist():
        margin = float(want[r, a[r]] - want[r, b[r]])
        assert margin <= 2 * diff, f"row {r}: token {b[r]} instead of {a[r]}, a margin of {margin:.3e}"


def _verified(runner: ModelRunner, out: SchedulerOutput, rows: list[int], logits: torch.Tensor) -> list[list[int]]:
    """The tokens the verify step emits per row from these logits (greedy rows)."""
    pending = runner.sample(StepLogits(out, rows, logits, None))
    assert pending is not None
    step = pending.result()
    assert step.proposed is not None
    return [[t.token_id for t in row] for row in step.tokens]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("kv", ["int8", "bf16"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graphed_verify_step_matches_the_eager_one(rng, tmp_path, batch, kv, window):
    """A verify step replayed from its bucket's graph (3 rows pad to 4) gives the eager step's
    logits (to bf16 tolerance: other matrix shapes, every row through the extend kernel) and
    verifies the same tokens."""
    starts, ks = CASES[batch]
    model_dir = make_hf_model_dir(tmp_path, "qwen2" if window else "llama", weight_scale=4.0,
                                  **(WINDOW if window else {}))
    engine, out = _verify_step(model_dir, rng, starts, ks, device="cuda", dtype="bf16", kv_cache_dtype=kv)
    runner = engine.runner
    assert runner.attention.windows == ([None, 9] if window else [None, None])
    graphs = runner.graphs
    assert list(graphs.verify) == [1, 2, 4, 8] and graphs.verify_width == 1 + K
    assert graphs.verify_bucket_for(out) == {1: 1, 3: 4, 8: 8}[batch]
    replays = []
    replay_verify = graphs.replay_verify
    graphs.replay_verify = lambda bucket: (replays.append(bucket), replay_verify(bucket))[1]
    with torch.inference_mode():
        torch.cuda.synchronize()
        rows_g, graph_logits = runner.forward_logits(out)
        assert graph_logits is not None
        graph_logits = graph_logits.clone()
        rows_e, eager_logits = runner.forward_logits(out, eager=True)
        assert eager_logits is not None
        assert replays == [graphs.verify_bucket_for(out)]  # the first from its graph, the second not
        assert rows_g == rows_e == list(range(batch))
        assert graph_logits.shape == eager_logits.shape == (sum(1 + k for k in ks), VOCAB)
        assert torch.isfinite(graph_logits).all()
        err = ((graph_logits - eager_logits).abs().max() / eager_logits.abs().max()).item()
        assert err <= 2e-2, f"graphed vs eager verify step: relative logit error {err:.3e}"
        _assert_same_choices(graph_logits, eager_logits)
        same_argmax = bool((graph_logits.argmax(-1) == eager_logits.argmax(-1)).all())
        tokens_g = _verified(runner, out, rows_g, graph_logits.clone())
        tokens_e = _verified(runner, out, rows_e, eager_logits.clone())
    if same_argmax:
        assert tokens_g == tokens_e


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_greedy_speculation_with_verify_graphs_is_plain_decoding(rng, tmp_path, kv):
    """Greedy speculative decoding with verify graphs (and async scheduling, the CUDA default)
    decodes plain decoding's tokens, graphs on in both: the same logits for every token (to bf16
    tolerance) while the tokens agree, and where they part, a near-tie in the plain run."""
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=3.0)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = {f"p{i}": (p, sp) for i, p in enumerate(_prompts(rng, 6))}
    cfg = dict(model=str(model_dir), device="cuda", dtype="bf16", kv_cache_dtype=kv, max_num_seqs=8,
               num_kv_blocks=256)
    plain = Run(EngineCore(EngineConfig(**cfg)), requests)
    engine = EngineCore(EngineConfig(**cfg, speculative="ngram", num_speculative_tokens=K))
    assert engine.runner.graphs and list(engine.runner.graphs.verify) == [1, 2, 4, 8]
    replays: list[int] = []
    replay_verify = engine.runner.graphs.replay_verify
    engine.runner.graphs.replay_verify = lambda bucket: (replays.append(bucket), replay_verify(bucket))[1]
    spec = Run(engine, requests)
    assert replays, "no verify step ran from a graph"
    assert engine.stats().spec_num_accepted_tokens > 0, "no proposal was ever accepted: nothing was tested"
    assert_plain_up_to_near_ties(plain, spec, sp)


def assert_plain_up_to_near_ties(plain: Run, spec: Run, sp: SamplingParams, rel: float = 5e-2) -> None:
    """Every request of `spec` took `plain`'s tokens from the same logits (within `rel` of their
    largest magnitude, bf16 on CUDA) while they agree, and where they part, plain decoding's choice
    was a near-tie (a margin within twice that)."""
    for rid in plain.tokens:
        mine, theirs = plain.tokens[rid], spec.tokens[rid]
        assert len(mine) == len(theirs) == sp.max_tokens
        j = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
        for i in range(min(j + 1, len(mine))):
            want, got = plain.logits[(rid, i)], spec.logits[(rid, i)]
            tol = rel * float(want.abs().max())
            diff = float((got - want).abs().max())
            assert diff <= tol, f"{rid}: the logits of token {i} differ by {diff:.3e} (tolerance {tol:.3e})"
        if j < len(mine):
            want = plain.logits[(rid, j)]
            margin = float(want[mine[j]] - want[theirs[j]])
            assert margin <= 2 * rel * float(want.abs().max()), (
                f"{rid}: token {j} is {theirs[j]}, not {mine[j]}, where plain decoding's choice had a margin of {margin:.3e}")
