"""EngineCore: loads the model, sizes the KV pool, and advances every request by one step.

Synchronous and single-threaded on purpose: `run_core_loop` (engine/core/loop.py) steps it on a
thread of the server or in a process of its own, behind the EngineClient the service holds
(engine/client/). One `step()`: schedule -> launch -> read back -> update.
"""

from __future__ import annotations

import concurrent.futures
import gc
import random
from collections.abc import Callable

import structlog
import torch

from pie.model.config import ModelConfig
from pie.model.loader import load_model
from pie.model.parallel import TensorParallel, check_shardable

from ..config import EngineConfig, usable_cores
from ..device import TORCH_DTYPES, auto_dtype, resolve_device
from ..errors import EngineDeadError
from ..limits import check_request
from ..messages import EngineInfo, EngineStats, RequestOutput, RequestStatus, StepTimes
from ..model_check import check_vocab, read_model_config, read_tokenizer
from ..runner.kv_cache import KVCache
from ..runner.kv_sizing import num_kv_blocks
from ..runner.model_runner import ModelRunner
from ..runner.pending import PendingStep
from ..runner.tensor_parallel import Leader, check_devices
from ..runner.warm_up import warm_up
from ..sample.structured import GrammarCompiler, StructuredOutputs, TokenMasks
from ..sampling_params import SamplingParams
from ..scheduling.block_manager import BlockManager
from ..scheduling.detokenizer import IncrementalDetokenizer
from ..scheduling.request import Request, SampleGroup
from ..scheduling.scheduler import Scheduler
from ..scheduling.step import SchedulerOutput
from ..spec_decode.draft import DraftModel, load_draft
from . import build
from .build import make_speculator, smooth_kv, spec_stats, use_kernels
from .step_timer import StepTimer

log = structlog.get_logger(__name__)

# A step that finds nothing to run but requests whose constraints still compile waits this long at
# most for one to finish (instead of spinning), so commands still come in between waits.
GRAMMAR_WAIT_S = 0.05


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads or max(1, usable_cores() - 1))
        full = read_model_config(config.model)  # StartupError naming the folder when it cannot be served
        dtype_name = config.dtype if config.dtype != "auto" else auto_dtype(self.device, full)
        self.dtype_name = dtype_name
        # Tensor parallelism: this is rank 0; the workers start now and load their shares alongside.
        self._tp: Leader | None = None
        tp = None
        if config.tensor_parallel_size > 1:
            check_shardable(full, config.tensor_parallel_size)  # before any process starts
            check_devices(self.device, config.tensor_parallel_size,
                          torch.cuda.device_count() if self.device.type == "cuda" else 0)
            self._tp = Leader(config, config.tensor_parallel_size, self.device, dtype_name)
            tp = self._tp.tp
        try:
            self._build(config, tp)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, tp: TensorParallel | None) -> None:
        dtype_name = self.dtype_name
        self.model, self.model_config = load_model(config.model, device=self.device, dtype=TORCH_DTYPES[dtype_name],
                                                   tp=tp)
        self.model.eval()
        use_kernels(self.model, config, self.device)
        self.tokenizer = read_tokenizer(config.model, self.model_config)
        mc: ModelConfig = self.model_config
        check_vocab(config.model, mc, self.tokenizer)
        factors = smooth_kv(self.model, mc, self.tokenizer, self._tp, config)  # None: not for this cache
        self.adapters = build.make_adapters(self.model, config, self.device, factors)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.max_model_len = mc.max_model_len if config.max_model_len is None else min(config.max_model_len, mc.max_model_len)

        local = self.model.config  # this rank's heads (all of them without tensor parallelism)
        block_bytes = KVCache.bytes_per_block(
            num_layers=local.num_hidden_layers, block_size=config.block_size,
            num_kv_heads=local.num_key_value_heads, head_dim=local.head_dim, kv_cache_dtype=config.kv_cache_dtype)
        # A draft model (speculative decoding) is loaded before the pool is sized: its weights take
        # memory first, and each block of the pool has a draft half of its own (engine/spec_decode/draft.py).
        self.draft: DraftModel | None = None
        if config.speculative == "draft":
            self.draft = load_draft(config, self.device, TORCH_DTYPES[dtype_name], self.tokenizer, self.max_model_len)
            block_bytes += self.draft.block_bytes(config)
        num_blocks = num_kv_blocks(config, self.device, block_bytes, self.max_model_len,
                                   lambda n: self._make_runner(self._make_kv_cache(n)))
        self.kv_cache = self._make_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
        self.kv_tiers = build.make_kv_tiers(config, self.kv_cache, self.block_manager, self.device, dtype_name)
        # Structured output (engine/sample/structured.py): llguidance over the model's vocabulary.
        self.structured = StructuredOutputs(
            GrammarCompiler(self.tokenizer.backend.to_str(), self.vocab_size, self.eos_token_ids),
            max_num_seqs=config.max_num_seqs, pin_memory=self.device.type == "cuda")
        self.speculator = make_speculator(config, self.vocab_size, self.draft, self.device, self.max_model_len,
                                          num_blocks)  # speculative decoding; None unless asked for
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
            stall_factor=config.decode_stall_factor, stall_share=config.decode_stall_share,
            structured=self.structured, speculator=self.speculator, batch_invariant=config.batch_invariant,
            adapters=self.adapters)
        self.runner = self._make_runner(self.kv_cache)
        if self.device.type == "cuda":
            warm_up(self.runner)
            if not config.enforce_eager:
                if self._tp is not None:
                    self._tp.capture()  # every rank captures the same buckets, collectives inside
                self.runner.capture_cuda_graphs()
                # the stall bound's decode-step times until it measures one (engine/scheduling/stall.py)
                self.scheduler.stall.prior = dict(self.runner.graphs.replay_seconds)
                self.scheduler.stall.kv_token_s = self.runner.graphs.kv_token_seconds or 0.0
        self._seed_source = random.Random(config.seed)
        self._async = (self.device.type == "cuda") if config.async_scheduling is None else config.async_scheduling
        self._pending: PendingStep | None = None  # async scheduling: the launched step not read back yet
        self.step_times = StepTimes()  # for the metrics (pie_step_duration_seconds)
        self._timer = StepTimer(self.scheduler.stall, self.step_times)  # what the stall bound learns from
        # Everything alive now (model, tokenizer, modules: ~10^5-10^6 objects) lives as long as the
        # engine: out of the cyclic collector's sight, a collection under load scans only what
        # requests create (`gc.unfreeze()` undoes it, as the tests do).
        gc.collect()
        gc.freeze()
        log.info("engine_ready", model=config.model, architecture=mc.architecture, device=str(self.device),
                 dtype=dtype_name, kv_cache_dtype=config.kv_cache_dtype, kv_blocks=num_blocks,
                 block_size=config.block_size, kv_cache_tokens=num_blocks * config.block_size,
                 max_model_len=self.max_model_len, speculative=config.speculative,
                 num_speculative_tokens=config.num_speculative_tokens if config.speculative else None)

    def _make_kv_cache(self, num_blocks: int) -> KVCache:
        local = self.model.config  # this rank's KV heads
        return KVCache(num_layers=local.num_hidden_layers, num_blocks=num_blocks, block_size=self.config.block_size,
                       num_kv_heads=local.num_key_value_heads, head_dim=local.head_dim,
                       kv_cache_dtype=self.config.kv_cache_dtype, device=self.device)

    def _make_runner(self, kv_cache: KVCache) -> ModelRunner:
        if self._tp is not None:
            self._tp.new_cache(kv_cache.num_blocks)  # each worker builds its pool of these block ids
        return ModelRunner.for_model(self.model, kv_cache, self.config, self.device, self.max_model_len,
                                     tp_leader=self._tp)

    def close(self) -> None:
        """Stops its workers (the KV tiers' copies land first); it serves no more steps after this."""
        for part in ("structured", "kv_tiers"):  # (a half-built engine may lack them)
            if getattr(self, part, None) is not None:
                getattr(self, part).close()
        if self._tp is not None:
            self.runner.drop_cuda_graphs()  # before the process group their collectives belong to
            self._tp.close()

    # ---- requests in and out -------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raises RequestError for a request that could never be served, a structured output that
        does not compile included (compiled here, on the caller's thread)."""
        check_request(prompt_token_ids, sampling, config=self.config, vocab_size=self.vocab_size,
                      max_model_len=self.max_model_len, num_kv_blocks=self.block_manager.num_total_blocks)
        if sampling.structured is not None:
            self.structured.compiler.check(sampling.structured)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                    priority: int = 0, streamed: bool = False, adapter: str | None = None) -> SampleGroup:
        """Queues a request its client has validated (`check_request`, where requests enter the
        engine: EngineClient.submit, or `generate` here). With sampling.n > 1, n samples
        (ids f"{request_id}#{i}") whose outputs carry `request_id` and `index` = i; sample i draws
        from seed + i when a seed is given (so one seed reproduces all n), else from a random seed
        of its own. `priority`: lower is scheduled first (engine/scheduling/scheduler.py); `streamed`:
        its caller reads tokens as they come (the stall bound protects its decodes). A structured
        output's constraint starts compiling now (on a thread; the samples are admitted once it is
        done). `adapter`: the LoRA adapter it runs on (AdapterNotFoundError). ValueError for an id in use."""
        lora = build.resolve_adapter(self.adapters, adapter)
        n, group = sampling.n, SampleGroup(request_id)
        for i in range(n):
            grammar = self.structured.grammar_for(sampling.structured) if sampling.structured is not None else None
            seed = (sampling.seed + i) % 2**63 if sampling.seed is not None else self._seed_source.getrandbits(63)
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                 skip_special_tokens=sampling.skip_special_tokens, stop=sampling.stop,
                                                 min_tokens=sampling.min_tokens)
            Request(request_id if n == 1 else f"{request_id}#{i}", prompt_token_ids, sampling,
                    eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, parent_id=request_id,
                    index=i, wait_for=group.samples[0] if i else None, grammar=grammar,
                    arrival_time=group.samples[0].arrival_time if i else None,
                    seed=seed, detokenizer=detokenizer, group=group, priority=priority, streamed=streamed,
                    adapter=lora)
        self.scheduler.add_request(group)
        return group

    def adapter_command(self, cmd: build.AdapterCommand) -> build.AdapterReply:
        """Loads or unloads a LoRA adapter (engine/scheduling/adapters.py) between steps."""
        return build.adapter_command(self.adapters, cmd)

    def abort(self, request_id: str) -> bool:
        """Drops a request (every sample of it) and frees its blocks now. False for an unknown id."""
        return self.scheduler.abort(request_id)

    def abort_all(self) -> list[str]:
        """Aborts every request (shutdown); returns their ids."""
        ids = list(self.scheduler.groups)
        for rid in ids:
            self.scheduler.abort(rid)
        return ids

    def info(self) -> EngineInfo:
        """What the service reads about this engine (fixed once it is built)."""
        return EngineInfo(config=self.config, model_config=self.model_config, max_model_len=self.max_model_len,
                          vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids, device=str(self.device),
                          dtype_name=self.dtype_name, num_kv_blocks=self.block_manager.num_total_blocks)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_total=self.block_manager.num_total_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            requests_running=self.scheduler.num_running,
            requests_waiting=self.scheduler.num_waiting,
            prefix_cache_queries=self.block_manager.prefix_cache_queries,
            prefix_cache_hits=self.block_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_blocks_cached=self.block_manager.num_cached_free_blocks,
            adapters=build.adapter_states(self.adapters, self.scheduler.waiting),
            requests_waiting_by_priority=self.scheduler.num_waiting_by_priority(),
            step_buckets={kind: list(counts) for kind, counts in self.step_times.counts.items()},
            step_seconds=dict(self.step_times.sums),
            step_prompt_tokens=self.step_times.prompt_tokens,
            steps_unbounded=self.scheduler.stall.unbounded_steps,
            steps_stalled=self.scheduler.stall_budget.stall_steps,
            stall_fixed_s=self.scheduler.stall.fixed_s,
            stall_prompt_token_s=self.scheduler.stall.per_prompt_token_s or 0.0,
            stall_decode_ratio=self.scheduler.stall.decode_ratio,
            **spec_stats(self.speculator), **(self.kv_tiers.stats() if self.kv_tiers is not None else {}),
        )

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule -> launch -> read back -> update: advances every scheduled request by one
        forward pass and returns the outputs that are ready. Every kind of step takes this path
        (prompt chunks and decodes, structured output's masks, speculative proposals): the
        scheduler plans it (SchedulerOutput), `_launch` queues it on the device, its tokens come
        back as one StepOutput, and `Scheduler.update_from_output` closes it.

        Synchronous (the CPU default): this step's outputs. Async scheduling (the CUDA default)
        reads each step back one step later, while the next one runs (`_step_overlapped`)."""
        if self._async:
            return self._step_overlapped()
        out = self.scheduler.schedule()
        launched = None
        if out.scheduled:
            try:
                launched = self._launch(out)
            except Exception as e:  # an engine fault fails this step's requests, not the engine
                self._timer.idle()  # the failed step's time is no step's
                return self._step_failed([s.request for s in out.scheduled], e)
        else:
            self._wait_for_grammars()
        self.scheduler.step_launched(out)
        self._pending = launched
        self._timer.launched(out, launched)
        return self._collect()

    def _launch(self, out: SchedulerOutput, read_back: Callable[[], None] | None = None) -> PendingStep | None:
        """Queues the step on the device (`ModelRunner.launch`): its proposals (speculative
        decoding), the forward pass, then the sampling after the rows' token masks (structured
        output), which the host fills while the device runs the forward pass. `read_back`, under
        async scheduling: reads the previous step back before the masks are filled (the matchers
        take its tokens first)."""
        spec = self.speculator
        draft = spec.propose(out) if spec is not None and out.num_spec_tokens else None
        rows = out.sampling_requests
        if not any(r.grammar is not None for r in rows):
            return self.runner.launch(out) if draft is None else self.runner.launch(out, draft=draft)

        def masks() -> TokenMasks | None:
            if read_back is not None:
                read_back()
            return self.structured.fill(rows, bool(out.num_spec_tokens))

        return self.runner.launch(out, masks=masks, draft=draft)

    def _step_overlapped(self) -> list[RequestOutput]:
        """`step` under async scheduling: this step is queued on the device, then the previous
        step's tokens are read back and turned into outputs while the device runs, so the host's
        bookkeeping hides behind the GPU. A request that ends on a token (EOS, stop token, stop
        string) may so run one step too many, whose token is dropped; length limits are known
        from the counts and stop at once.

        Invariants (tests/engine/invariants.py checks them after every step):
        - At most one step is pending (`_pending`). A request holds at most one placeholder token,
          its newest, and only while it is a row of the pending step.
        - Blocks freed while the pending step may still write them (its request aborted, finished
          or preempted meanwhile) go back to the pool at once and may serve another request in
          the next step. That is safe only because every step's copies, kernels and sampling are
          queued on one CUDA stream, in order: the pending step's writes land before anything a
          later step does to those blocks. The runner asserts that each step launches on the
          stream it was built on.
        - The previous step's tokens are read back (`update_from_output`) before this step counts
          as launched (`step_launched`), so the blocks it fills are hashed with known ids.
        - A step that verified proposals is read back before the next is scheduled: proposals
          need the tokens, and how many were accepted decides where the next step starts.
        Structured output: the previous step is read back between the forward pass and the masks
        (`_launch`). Filling the masks on a thread from the moment the matchers took the tokens,
        beside the rest of the bookkeeping, is slower than filling them here."""
        early: list[RequestOutput] = []
        spec = self.speculator
        if spec is not None and self._pending is not None and (
                self._pending.speculative or spec.active(self.scheduler.num_running)):
            early = self._collect()
        out = self.scheduler.schedule()
        previous: list[RequestOutput] | None = None  # the previous step's outputs, once read back

        def read_back() -> None:
            nonlocal previous
            previous = self._collect()

        launched = None
        if out.scheduled:
            try:
                launched = self._launch(out, read_back)
            except Exception as e:  # an engine fault fails this step's requests, not the engine
                return (early + (previous or []) + self._collect()
                        + self._step_failed([s.request for s in out.scheduled], e))
        elif self._pending is None:
            self._wait_for_grammars()
        if previous is None:
            read_back()  # the previous step's tokens, while this one runs
        self.scheduler.step_launched(out)
        self._pending = launched
        self._timer.launched(out, launched)
        assert previous is not None
        return early + previous if early else previous

    def _wait_for_grammars(self) -> None:
        """Nothing could be scheduled: if requests wait for their constraints to compile, waits a
        little for one (so that the loop does not spin while a large grammar compiles)."""
        compiling = self.scheduler.compiling()
        if compiling:
            concurrent.futures.wait(compiling, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def _collect(self) -> list[RequestOutput]:
        """Reads back the pending step's tokens (waiting for the device) and closes that step."""
        pending, self._pending = self._pending, None
        if pending is None:
            self._timer.idle()
            return []
        try:
            step = pending.result()
        except Exception as e:
            return self._step_failed(pending.all_requests, e)
        self._timer.done(pending.done)
        return self.scheduler.update_from_output(step)

    def _step_failed(self, requests: list[Request], e: Exception) -> list[RequestOutput]:
        self._check_workers(e)
        live = [r for r in requests if not r.finished]
        log.exception("step_failed", request_ids=[r.request_id for r in live])
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        if oom and torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand back what the failed step held before retries come
        return self.scheduler.fail(live, f"{type(e).__name__}: {e}", out_of_memory=oom)

    def _check_workers(self, e: BaseException) -> None:
        """Under tensor parallelism a failed step ends the engine: the ranks' collectives no longer
        line up (a worker died, or one rank failed alone). EngineDeadError says which."""
        if self._tp is not None:
            raise EngineDeadError(f"tensor-parallel step failed ({type(e).__name__}: {e}); "
                                  f"{self._tp.lost() or 'all workers still run'}") from e

    # ---- convenience for tests and offline use ------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 adapters: list[str | None] | None = None) -> list[list[int]]:
        """Runs prompts to completion on this thread; returns the generated token ids of each
        (of sample 0 when sampling.n > 1). Each prompt is checked as a client would (`check_request`).
        `adapters`: each prompt's LoRA adapter (None: the base model), all in one batch."""
        ids = [f"offline-{i}-{self._seed_source.getrandbits(32):08x}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, p, a in zip(ids, prompts, adapters or [None] * len(prompts), strict=True):
            self.check_request(p, sampling)
            self.add_request(rid, p, sampling, adapter=a)
        while self.has_unfinished():
            for o in self.step():
                if o.index == 0:
                    results[o.request_id].extend(o.new_token_ids)
                if o.status == RequestStatus.FINISHED_ERROR:
                    raise RuntimeError(o.error)
        return [results[i] for i in ids]
