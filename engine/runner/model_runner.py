"""Turns a SchedulerOutput into one forward pass and one batched sample.

The step's inputs are staged into the runner's buffers (engine/runner/staging.py); a pure decode step
replays a CUDA graph where one was captured (engine/runner/cuda_graphs.py), and so does a verify step of
speculative decoding whose rows are all decodes (in the strided layout of its verify graph,
`StepStager.stage_verify`); a step with prompt tokens of up to mixed_graph_max_tokens tokens
replays the piecewise graphs of its token bucket, attention eager between them
(`PiecewiseGraphs`); anything else runs eagerly. The logits of the rows that sample go through
the batched sampler (engine/sample/sampler.py) on the device, and what it drew comes back to the host
in one copy: the only device->host
synchronization of a step, which `PendingStep.result()` waits for (async scheduling reads it a
step later). A step that holds prompt chunks of requests asking for prompt logprobs also makes the
logits of those prompt positions and their logprobs (engine/runner/prompt_logprobs.py), which come back
with the same synchronization; such a step runs eagerly. Structured output's token masks, where a
step has them, are applied to the logits on the device before sampling, after the forward pass
(and after a CUDA graph's replay): `launch` = `forward` then `sample`, which the engine calls apart
when it fills masks on the host while the device runs the forward pass. Under tensor parallelism
this runner is rank 0's: it hands each step's inputs to the workers first (`StepBroadcast`), and
the workers follow (engine/runner/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import structlog
import torch

from pie.kernels import reference
from pie.model.llama import LlamaForCausalLM

from ..config import EngineConfig
from ..device import to_device
from ..sample.rejection import DraftProbs, verify
from ..sample.sampler import sample
from ..sample.structured import TokenMasks
from ..sample.tensors import SamplingTensors
from ..sampling_params import MAX_LOGPROBS, SamplingParams
from ..scheduling.request import Request
from ..scheduling.step import SchedulerOutput, StepOutput
from .attention import AttentionMetadata, PagedAttention
from .cuda_graphs import CudaGraphs, PiecewiseGraphs
from .kv_cache import KVCache
from .pending import PendingStep, StepLogits
from .prompt_logprobs import PromptLogprobRows
from .staging import StepStager, adapter_slots
from .step_layout import LastSample, StepFacts

log = structlog.get_logger(__name__)


class StepBroadcast(Protocol):
    """Rank 0's link to its tensor-parallel workers (tensor_parallel.Leader): each step's inputs
    go to them before rank 0 runs its share."""

    def forward(self, facts: StepFacts, ints: torch.Tensor, tables: torch.Tensor, graph_batch: int | None,
                prompt_index: torch.Tensor | None) -> None: ...


def last_tokens(hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """Each sequence's last token's row of `hidden` (T, hidden) -> (B, hidden)."""
    if metadata.max_query_len == 1:
        return hidden  # pure decode: every token is its sequence's last
    return hidden[metadata.query_start_loc[1:].to(torch.int64) - 1]



class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, *, vocab_size: int, softmax_scale: float,
                 device: torch.device, attention_backend: str = "auto", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
                 windows: list[int | None] | None = None, tp_leader: StepBroadcast | None = None,
                 processed_logprobs: bool = False, max_spec_tokens: int = 0, spec_tokens_per_row: int = 0,
                 mixed_graph_max_tokens: int = 0, batch_invariant: bool = False) -> None:
        self.model = model
        # Speculative decoding: proposals one step verifies at most (their rows come back too), and
        # per row (K): verify graphs hold max_spec_tokens // K rows of 1 + K tokens at most.
        self.max_spec_tokens = max_spec_tokens
        self.spec_tokens_per_row = spec_tokens_per_row if max_spec_tokens else 0
        # A draft model's runner (engine/spec_decode/draft.py) stages rows that run into the proposals.
        self.reads_proposals = False
        # Report logprobs of the logits each token was chosen from, not the raw ones (`pie serve
        # --logprobs-mode processed`; engine/sample/sampler.py).
        self.processed_logprobs = processed_logprobs
        self._tp = tp_leader  # rank 0 of a tensor-parallel group: each step goes to the workers first
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_model_len = max_model_len
        self.attention = PagedAttention(kv_cache, softmax_scale, attention_backend, windows, max_model_len,
                                        batch_invariant)
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_blocks = -(-max_model_len // self.block_size)
        on_cuda = device.type == "cuda"
        k = self.spec_tokens_per_row
        self.verify_rows = max_spec_tokens // k if k else 0  # rows of the largest verify graph
        # A verify graph's padded row reads keys up to K positions past the context's end
        # (StepStager.stage_verify): its block tables are that much wider.
        self.stager = StepStager(block_size=self.block_size, max_num_seqs=max_num_seqs, max_tokens=self.max_tokens,
                                 max_blocks=-(-(max_model_len + k) // self.block_size), device=device,
                                 verify_tokens=self.verify_rows * (1 + k) if k else 0,
                                 prompt_rows_decode=not batch_invariant)
        self.graphs = CudaGraphs(prompt_rows_decode=not batch_invariant)
        # Steps with prompt tokens: piecewise graphs up to this many tokens (0: none; cuda_graphs.py).
        # (not under tensor parallelism: neither rank 0 nor the workers, whose model has `tp` too)
        self._sharded = getattr(model, "tp", None) is not None
        self.mixed_graph_max_tokens = 0 if self._sharded else min(mixed_graph_max_tokens, self.max_tokens)
        self.pieces = PiecewiseGraphs()
        if on_cuda:
            # Sampled ids, logprobs and top logprobs of a step, on their way to the host (launch()).
            sample_cols = 2 + 2 * MAX_LOGPROBS + (1 if max_spec_tokens else 0)  # + accepted, verifying
            self._host_samples = [torch.empty((max_num_seqs + max_spec_tokens) * sample_cols, dtype=torch.float64,
                                              pin_memory=True) for _ in range(2)]
            self._parity = 0
            # The same for prompt logprobs, allocated when a step first computes some.
            self._host_prompt: list[torch.Tensor] | None = None
        # Every step runs on this stream: async scheduling frees and reuses blocks that a queued
        # step may still write, which is safe only in stream order (see EngineCore.step).
        self._stream = torch.cuda.current_stream(device) if on_cuda else None
        # Structured output's masks onto the logits: the Triton kernel on CUDA, its torch twin here.
        if on_cuda:
            from pie.kernels import triton_bitmask

            self._apply_masks = triton_bitmask.apply_token_bitmask_
        else:
            self._apply_masks = reference.apply_token_bitmask_
        # Async scheduling: the last step's sampled ids stay on the device; a request whose newest
        # token is a placeholder (sampled, not yet read back) takes its input id from there.
        self._last: LastSample | None = None
        self._last_tensors: SamplingTensors | None = None  # the sampling inputs of its rows

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, kv_cache: KVCache, config: EngineConfig, device: torch.device,
                  max_model_len: int, tp_leader: StepBroadcast | None = None) -> ModelRunner:
        """The runner an engine of `config` uses over `model` (one rank's share of it under tensor
        parallelism) and `kv_cache`: the engine and its tensor-parallel workers build theirs alike."""
        mc = model.config
        k = config.num_speculative_tokens if config.speculative is not None else 0
        return cls(model, kv_cache, vocab_size=mc.vocab_size, softmax_scale=mc.attn_scale, device=device,
                   attention_backend=config.attention_backend, max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                   windows=[mc.layer_window(i) for i in range(mc.num_hidden_layers)], tp_leader=tp_leader,
                   processed_logprobs=config.logprobs_mode == "processed",
                   max_spec_tokens=k * min(config.speculative_max_batch, config.max_num_seqs), spec_tokens_per_row=k,
                   mixed_graph_max_tokens=config.mixed_graph_max_tokens, batch_invariant=config.batch_invariant)

    # ---- forward --------------------------------------------------------------------------------
    def forward_logits(self, out: SchedulerOutput, *, eager: bool = False,
                       prompt: PromptLogprobRows | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Runs the step's tokens; returns the scheduled rows that sample and their logits (R, V)
        fp32 (None when no row samples). `eager` skips the CUDA graphs (tests compare the two).
        `prompt`: prompt positions whose logprobs the step computes too, into `prompt.packed`
        (such a step runs eagerly: a graph makes no hidden states)."""
        verify_batch = None if eager or prompt is not None else self.graphs.verify_bucket_for(out)
        if verify_batch is not None:
            # A verify step from its graph: all of its rows' tokens, each row's logits taken by the
            # staged index (the newest token's position, then each proposal's, row by row).
            assert self._tp is None, "no verify graphs under tensor parallelism"
            step = self.stager.stage_verify(out, [s.request.block_ids for s in out.scheduled], verify_batch,
                                            self.graphs.verify_width)
            assert step.logits_index is not None
            logits = self.graphs.replay_verify(verify_batch)
            return list(range(step.num_seqs)), logits.index_select(0, step.logits_index)
        step = self.stager.stage(out, [s.request.block_ids for s in out.scheduled],
                                 None if eager or prompt is not None else self.graphs.bucket_for(out), self._last,
                                 proposals=bool(out.num_spec_tokens) or self.reads_proposals)
        lora = getattr(self.model, "lora_step", None)  # (a wrapped model, in tests, may have none)
        if lora is not None:
            lora.buffer.copy_(to_device(torch.from_numpy(adapter_slots(out, lora.buffer.shape[0])), self.device))
        if self._tp is not None:
            self._tp.forward(step.facts, step.ints, step.metadata.block_tables, step.graph_batch,
                             None if prompt is None else prompt.index)
        rows = [i for i, s in enumerate(out.scheduled) if s.sample]
        if step.graph_batch is not None:
            return rows, self._rows_of(self.graphs.replay(step.graph_batch), rows, step.num_seqs)
        # (no pieces are captured under tensor parallelism: bucket_for finds none there)
        piece_bucket = None if eager or prompt is not None else self.pieces.bucket_for(step.input_ids.shape[0])
        self.attention.metadata = step.metadata
        try:
            if piece_bucket is not None:  # (bucket >= T, hidden): rows T.. are padding, never read below
                hidden = self.pieces.replay(piece_bucket, step.input_ids, step.positions, self.attention)
            else:
                hidden = self.model(step.input_ids, step.positions, self.attention)  # (T, hidden)
        finally:
            self.attention.metadata = None
        if self._tp is not None:  # the LM head is split by vocabulary: all ranks, every sequence
            logits = self.model.compute_logits(last_tokens(hidden, step.metadata))
            if prompt is not None:  # then the prompt positions, as the workers do
                prompt.compute(hidden, self.model.compute_logits, self.vocab_size)
            return rows, self._rows_of(logits, rows, step.num_seqs) if rows else None
        if prompt is not None:
            prompt.compute(hidden, self.model.compute_logits, self.vocab_size)
        if not rows:
            return rows, None
        if step.metadata.max_query_len == 1 and len(rows) == step.num_seqs:
            # one token a sequence, each its last (a piecewise replay's rows past them are padding)
            return rows, self.model.compute_logits(hidden[:step.num_seqs])
        # each sampling row's last token (and its proposals'), found on the host: to_device, no sync
        index = to_device(torch.from_numpy(out.logits_positions(rows)), self.device)
        return rows, self.model.compute_logits(hidden.index_select(0, index))

    def _rows_of(self, logits: torch.Tensor, rows: list[int], num_seqs: int) -> torch.Tensor:
        """The sampling rows' logits among a step's `num_seqs` rows (indexing with the list would
        copy it from pageable memory: a host sync)."""
        if len(rows) == num_seqs:
            return logits[:num_seqs]
        return logits.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), self.device))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, masks: Callable[[], TokenMasks | None] | None = None,
               draft: DraftProbs | None = None) -> PendingStep | None:
        """Queues the step's forward pass and sampling on the device and the copy of what is
        sampled back to the host; returns without waiting (None when no row samples and no prompt
        logprobs were computed). The sampled ids also stay on the device, as the next step's input
        ids of requests whose newest token is a placeholder. `masks`: called once the forward pass
        is queued, gives structured output's token masks of the sampling rows (of their logits
        rows, in a step with proposals), filled on the host while the device runs. `draft`: the
        draft model's distributions of the step's proposals (engine/spec_decode/speculator.py)."""
        step = self.forward(out)
        return self.sample(step, None if masks is None else masks(), draft)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> StepLogits:
        """Queues the step's forward pass (and its logits) on the device; returns without waiting."""
        assert self._stream is None or torch.cuda.current_stream(self.device) == self._stream, \
            "every step must run on the runner's CUDA stream (async scheduling relies on stream order)"
        prompt = PromptLogprobRows.plan(out, self.device)  # None unless a chunk asks for prompt logprobs
        return StepLogits(out, *self.forward_logits(out, prompt=prompt), prompt)

    @torch.inference_mode()
    def sample(self, step: StepLogits, masks: TokenMasks | None = None,
               draft: DraftProbs | None = None) -> PendingStep | None:
        """Queues the sampling of a step whose forward pass is queued (`forward`), after its token
        masks, and the copy of what is sampled back to the host (None when no row samples and no
        prompt logprobs were computed). A step with proposals verifies them (`_verify`)."""
        out, rows, logits, prompt = step.out, step.rows, step.logits, step.prompt
        if logits is None:
            return None if prompt is None else self._to_host([], None, prompt)
        if masks is not None:
            # Pinned host buffers: the copies are queued on the stream, behind the forward pass.
            bitmask = masks.bitmask.to(self.device, non_blocking=True)
            row_index = masks.rows.to(self.device, non_blocking=True)
            self._apply_masks(logits, bitmask, row_index)
        if out.num_spec_tokens:
            return self._verify(step, logits, draft)
        reqs = [out.scheduled[i].request for i in rows]
        last, last_tensors = self._last, self._last_tensors
        if last is not None and last_tensors is not None and not last_tensors.any_penalties and reqs == last.requests:
            # The same rows as the last step's sample, each one token further: only the step
            # counters (the random stream's position) change. The steady decode state.
            tensors = last_tensors.next_step()
            last_rows = last.rows
        else:
            # Penalties count output ids: a newest id not read back yet is read from the device,
            # and only for rows that use a penalty (the sampler selects them).
            pend = [(i, last.rows[r.request_id]) for i, r in enumerate(reqs)
                    if r.num_output_placeholders] if last is not None else []
            pending_ids = None
            if pend:
                assert last is not None, "a pending id without a last step"
                pending_ids = ([p[0] for p in pend], [p[1] for p in pend], last.ids)
            tensors = SamplingTensors.build(
                params=[r.sampling for r in reqs],
                seeds=[r.seed for r in reqs],
                steps=[r.num_output_tokens for r in reqs],
                prompt_ids=[r.prompt_token_ids for r in reqs],
                output_ids=[r.output_token_ids for r in reqs],
                vocab_size=logits.shape[-1],
                device=logits.device,
                pending_ids=pending_ids,
                eos_token_ids=[r.eos_token_ids for r in reqs],
            )
            last_rows = {r.request_id: i for i, r in enumerate(reqs)}
        result = sample(logits, tensors, processed_logprobs=self.processed_logprobs)
        self._last = LastSample(result.token_ids, reqs, last_rows)
        self._last_tensors = tensors
        # Everything sampled comes back in one transfer, packed as float64 columns (token ids are
        # exact in float64): id, logprob, then n top ids, n top logprobs.
        cols = [result.token_ids.double()[:, None], result.logprobs.double()[:, None]]
        if result.top_ids is not None and result.top_logprobs is not None:
            cols += [result.top_ids.double(), result.top_logprobs.double()]
        return self._to_host(reqs, torch.cat(cols, dim=1), prompt)

    def _verify(self, step: StepLogits, logits: torch.Tensor, draft: DraftProbs | None) -> PendingStep:
        """Samples each of a verify step's logits rows as plain decoding would sample that output
        token had the proposals before it been outputs, and judges the proposals
        (engine/spec_decode/speculator.py). Rows are read back as they come: no placeholder is left behind."""
        out = step.out
        scheduled = [out.scheduled[i] for i in step.rows]
        reqs = [s.request for s in scheduled]
        num_spec = [s.num_spec for s in scheduled]
        params: list[SamplingParams] = []
        seeds: list[int] = []
        steps: list[int] = []
        prompt_ids: list[list[int]] = []
        output_ids: list[list[int]] = []
        eos: list[tuple[int, ...]] = []
        next_ids: list[int] = []
        draft_rows: list[int] = []
        for r, k in zip(reqs, num_spec):
            assert not r.num_output_placeholders, f"{r}: a verify step's row with an id not read back"
            outputs, spec, base = r.output_token_ids, r.spec_token_ids, len(r.output_token_ids)
            draft_rows.extend(range(len(next_ids), len(next_ids) + k))
            for j in range(k + 1):
                params.append(r.sampling)
                seeds.append(r.seed)
                steps.append(base + j)
                prompt_ids.append(r.prompt_token_ids)
                output_ids.append(outputs + spec[:j] if j else outputs)
                eos.append(r.eos_token_ids)
                next_ids.append(spec[j] if j < k else -1)
        tensors = SamplingTensors.build(params=params, seeds=seeds, steps=steps, prompt_ids=prompt_ids,
                                        output_ids=output_ids, vocab_size=logits.shape[-1], device=logits.device,
                                        eos_token_ids=eos)
        ints = to_device(torch.tensor([next_ids, draft_rows + [0] * (len(next_ids) - len(draft_rows))],
                                      dtype=torch.int64), self.device)
        result, accepted = verify(logits, tensors, ints[0], ints[1, :len(draft_rows)] if draft is not None else None,
                                  draft, processed_logprobs=self.processed_logprobs)
        # The next step starts from what comes back, not from ids left on the device.
        self._last = self._last_tensors = None
        cols = [result.token_ids.double()[:, None], result.logprobs.double()[:, None], accepted.double()[:, None]]
        if result.top_ids is not None and result.top_logprobs is not None:
            cols += [result.top_ids.double(), result.top_logprobs.double()]
        return self._to_host(reqs, torch.cat(cols, dim=1), step.prompt, num_spec)

    def _to_host(self, reqs: list[Request], packed: torch.Tensor | None,
                 prompt: PromptLogprobRows | None, num_spec: list[int] | None = None) -> PendingStep:
        """Starts the copy of what the step sampled (`packed`: (R, 2 + 2n) float64, None when no row
        samples; with `num_spec`, a verify step's (N, 3 + 2n)) and of its prompt logprobs
        (`prompt.packed`) to the host."""
        n_top = 0 if packed is None else (packed.shape[1] - (2 if num_spec is None else 3)) // 2
        if packed is None:
            packed = torch.empty(0, 2, dtype=torch.float64, device=self.device)
        values = None
        if prompt is not None:
            assert prompt.packed is not None, "the forward pass computes the prompt logprobs"
            values = prompt.packed
        if packed.is_cuda:
            # Two pinned buffers, taken in turn: at most one step is pending, and its buffer is read
            # before the step after next writes into it. (A fresh pinned tensor per step cost a
            # cudaHostAlloc whenever the caching host allocator had no block of that size yet:
            # every new batch size in an engine's first minutes.)
            self._parity ^= 1
            host = self._host_samples[self._parity][:packed.numel()].view(packed.shape)
            host.copy_(packed, non_blocking=True)
            packed = host
            if values is not None:
                if self._host_prompt is None:  # every token of a step, with the most alternatives
                    size = self.max_tokens * (1 + 2 * MAX_LOGPROBS)
                    self._host_prompt = [torch.empty(size, dtype=torch.float64, pin_memory=True) for _ in range(2)]
                host = self._host_prompt[self._parity][:values.numel()].view(values.shape)
                host.copy_(values, non_blocking=True)
                values = host
            # One event per step, timed: the engine reads the step's time off the device's
            # clock as the gap to the previous step's (engine/core/step_timer.py).
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            done: torch.cuda.Event | None = event
        else:
            done = None
        return PendingStep(reqs, packed, n_top, done,
                             None if prompt is None or values is None else (prompt, values), num_spec)

    def execute(self, out: SchedulerOutput) -> StepOutput:
        """Runs the scheduled tokens and waits for the sample: what the step produced (nothing for
        a step of prompt chunks in the middle of their prompts)."""
        pending = self.launch(out)
        return StepOutput() if pending is None else pending.result()

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What a CUDA graph captures: the forward pass over the staged inputs (attention.metadata
        set) and the logits of every token, (T, V) fp32."""
        return self.model.compute_logits(self.model(input_ids, positions, self.attention))

    def capture_cuda_graphs(self) -> None:
        """Captures the decode forward pass and its logits for every batch bucket, with speculative
        decoding on the verify step's for every verify bucket, and the piecewise graphs of steps with
        prompt tokens up to mixed_graph_max_tokens (cuda_graphs.py)."""
        k = self.spec_tokens_per_row
        assert not k or self._tp is None, "speculative decoding does not run under tensor parallelism"
        self.graphs.capture(self.graph_forward, self.attention, self.stager, max_num_seqs=self.max_num_seqs,
                            max_model_len=self.max_model_len, verify_rows=self.verify_rows,
                            verify_width=1 + k if k else 0, time_replays=not self._sharded)
        if self.mixed_graph_max_tokens:
            self.pieces.capture(self.model, self.stager.dev_ints.dtype, self.mixed_graph_max_tokens, self.device)

    def drop_cuda_graphs(self) -> None:
        """Releases the captured graphs (every step runs eagerly after this)."""
        self.graphs.drop(self.device)
        self.pieces.drop()
