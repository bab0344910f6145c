"""Engine configuration: one validated dataclass, passed down explicitly (never read from env)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The bundled default model (model/bundled/): a ~7M-parameter Llama trained by `pie train` on the
# offline story corpus; `pie serve` serves it when no --model is given.
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "model" / "bundled" / "stories-7m")

# The one list of each choice (the CLI offers these, the engine checks them).
KV_CACHE_DTYPES = ("int8", "bf16", "fp16", "fp32")
MODEL_DTYPES = ("auto", "fp32", "bf16", "fp16")
ATTENTION_BACKENDS = ("auto", "triton", "torch")  # auto: triton on cuda, the torch reference elsewhere
# What TokenLogprob.logprob reports: log_softmax of the raw logits (vLLM v1's default), or of the
# logits the token was chosen from, after bias, penalties, temperature and filters (engine/sample/sampler.py).
LOGPROBS_MODES = ("raw", "processed")
KV_SMOOTHING = ("auto", "on", "off")  # kv_smoothing: model/smoothing.py
# Speculative decoding's proposers (engine/spec_decode/speculator.py): prompt lookup, or a small draft model.
SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16  # proposals per step at most: a verify row is 1 + K tokens
MAX_LORA_RANK = 512  # kernels/triton_lora.py keeps a slot's rank rows in one tile
LORA_SHRINKS = ("auto", "chunks", "gemm", "masked")  # kernels/triton_lora.py SHRINKS (not imported: the CPU path needs no triton)


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # Hugging Face-layout folder: config.json, *.safetensors, tokenizer.json
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda, cuda:N
    # weights/activations: auto = bf16 on cuda; on the cpu bf16 for a bf16 checkpoint where the CPU
    # has native bf16 (AVX512-BF16, AMX), else fp32 (engine.device.auto_dtype)
    dtype: str = "auto"
    kv_cache_dtype: str = "int8"  # int8: K/V quantized per (token, kv head); bf16/fp16/fp32 baselines
    block_size: int = 16  # tokens per KV block (page)
    # KV pool budget when num_kv_blocks is not given. None: on CUDA, what gpu_memory_fraction of the
    # device leaves after the weights and a profiling forward's peak; on the CPU, what max_num_seqs
    # sequences of the whole context can use, at most 1 GiB (engine/runner/kv_sizing.py).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_fraction: float = 0.9  # share of the whole device memory this engine may use (CUDA)
    # Queue step N on the device before reading step N-1's tokens back (see EngineCore.step).
    # None: on for CUDA, off on the CPU (where the host computes the forward pass itself).
    async_scheduling: bool | None = None
    enforce_eager: bool = False  # never replay CUDA graphs (decode and verify steps are captured by default on CUDA)
    # Steps with prompt tokens of up to this many tokens (capped by max_num_batched_tokens) replay
    # piecewise CUDA graphs, attention eager between the pieces (engine/runner/cuda_graphs.py); longer ones
    # run eagerly. 0: every such step eagerly. Not under tensor parallelism.
    mixed_graph_max_tokens: int = 2048
    num_kv_blocks: int | None = None  # exact pool size; overrides the byte budget (tests)
    max_num_seqs: int = 64  # running sequences per step at most (the batch cap)
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    # A step that carries prompt tokens beside a streamed decode (one whose caller reads tokens as
    # they come) may take at most this many times the decode step of the batch it heads to
    # (engine/scheduling/stall.py, learnt from step times); it bounds the inter-token stalls a long
    # prompt causes the streams. Requests read whole (unary calls, offline work) are not bounded.
    # 0 = only max_num_batched_tokens bounds a step. The default is the factor that kept a served
    # burst's inter-token p99 within that many medians for the least throughput lost.
    decode_stall_factor: float = 3.0
    # Share of the streams' inter-token gaps that steps past that bound may stall while a backlog of
    # prompts waits (a burst): a few whole-budget steps early in the ramp, where they stall few
    # streams, buy back the bound's cost in throughput (engine/scheduling/stall.py, StallBudget).
    # Below 0.01. Off by default: it buys a burst's throughput with a higher inter-token p99, a
    # trade the A/B gate calls a regression. 0 = every step with a streamed decode bounded.
    decode_stall_share: float = 0.0
    max_model_len: int | None = None  # context served; default and cap: the model's
    max_waiting: int = 256  # waiting queue bound; beyond it the service answers RESOURCE_EXHAUSTED
    seed: int = 0  # seeds the stream that draws seeds for requests that bring none
    attention_backend: str = "auto"  # auto (triton on cuda, torch on cpu), triton, torch (reference)
    # torch intra-op threads when the model runs on the CPU; None = the cores this process may use
    # but one, which the gRPC loop needs: OpenMP threads that wait on a descheduled peer slow every
    # step, more than the extra thread gains.
    cpu_threads: int | None = None
    enable_prefix_caching: bool = True  # reuse K/V of full blocks shared by prompts (and n > 1 samples)
    # int8 caches: even out K/V channel magnitudes (a calibration pass at load, folded into the
    # weights; model/smoothing.py), so a few massive channels do not spend every token's int8 range.
    # auto: per layer and kv head, only where the calibration pass measures that it lowers the int8
    # attention error (smoothing everywhere costs a trained checkpoint perplexity); on:
    # everywhere; off: never.
    kv_smoothing: str = "auto"
    # Ranks sharing the model (engine/runner/tensor_parallel.py): this engine is rank 0 and starts N - 1
    # worker processes, one per further GPU (or CPU process, gloo).
    tensor_parallel_size: int = 1
    logprobs_mode: str = "raw"  # raw | processed: which logits generated tokens' logprobs come from
    # One answer per seed: every kernel on a request's path reduces in an order set by the request's
    # own tokens, never by the other rows of its step (projections through kernels/triton_matmul.py,
    # decode splits at fixed key positions, prompt tiles never shrunk for short chunks), so a seeded
    # request gives the same tokens alone, in any batch, cold, cached or chunked. The Triton path
    # (CUDA, or Triton's interpreter); not with tensor parallelism or speculative decoding.
    batch_invariant: bool = False
    # Speculative decoding (engine/spec_decode/speculator.py): None = off (the default: decoding as without it);
    # "ngram" proposes from earlier text, "draft" from `draft_model`. One forward pass verifies
    # `num_speculative_tokens` proposals per request (fewer where fewer are found or fit).
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None  # HF-layout folder of the draft (speculative="draft"); same tokenizer
    # Speculation runs only in steps with at most this many running decodes: above it, verifying
    # proposals costs more than it saves (benchmarks/speculative.py measures where).
    speculative_max_batch: int = 8
    # n-gram proposer: the longest suffix of this many tokens down to the shorter bound that occurred
    # earlier proposes what followed it (vLLM's prompt_lookup_max / prompt_lookup_min).
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # LoRA adapters (engine/scheduling/adapters.py): GPU slots for the adapters requests run on at once (0: no
    # adapters; the slots' memory is set aside before the KV pool is sized), the largest rank a
    # slot holds, and adapters loaded at start as (name, PEFT folder).
    max_loras: int = 0
    max_lora_rank: int = 16
    loras: tuple[tuple[str, str], ...] = ()
    # How the Triton path makes each row's x . A^T (kernels/triton_lora.py SHRINKS): "chunks" (its
    # own kernels, batch-invariant), "gemm" (one library GEMM over every slot's A) or "masked"
    # (library GEMMs only, every slot's delta computed and the others' zeroed); neither of the
    # last two with batch_invariant. "auto": gemm, or chunks with batch_invariant.
    lora_shrink: str = "auto"
    # Tiers below the pool (engine/offload/): full prefix-cache blocks the pool lets go of are
    # copied, as stored (int8 data with its scales), into this much host memory (pinned on CUDA;
    # 0 = no tiers) and, with kv_disk_dir, into files there of at most kv_disk_gib in all, which a
    # restarted server of the same model, dtypes and block size reads again. A prompt whose prefix
    # is found there is read back instead of computed.
    kv_host_gib: float = 0.0
    kv_disk_dir: str | None = None
    kv_disk_gib: float | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.mixed_graph_max_tokens < 0:
            raise ValueError(f"mixed_graph_max_tokens must be >= 0, got {self.mixed_graph_max_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be >= 1")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.decode_stall_factor and self.decode_stall_factor <= 1.0:
            raise ValueError(f"decode_stall_factor must be 0 (off) or > 1, got {self.decode_stall_factor}")
        if not 0.0 <= self.decode_stall_share < 0.01:
            raise ValueError(f"decode_stall_share must be in [0, 0.01) (0 = off; at 1% a stall is the p99 inter-token "
                             f"gap), got {self.decode_stall_share}")
        if self.kv_smoothing not in KV_SMOOTHING:
            raise ValueError(f"kv_smoothing must be one of {KV_SMOOTHING}, got {self.kv_smoothing!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self._check_speculative()
        self._check_loras()
        self._check_kv_tiers()
        if self.batch_invariant:
            if self.attention_backend == "torch":
                raise ValueError("batch_invariant runs the Triton kernels: not with attention_backend='torch'")
            if self.tensor_parallel_size > 1:
                raise ValueError("batch_invariant is not for tensor parallelism (its all-reduce sums in an "
                                 "order set by the step's size)")
            if self.speculative is not None:
                raise ValueError("batch_invariant is not for speculative decoding (a verify step computes a "
                                 "token with the prompt kernel, a decode step with the decode kernel)")

    def _check_kv_tiers(self) -> None:
        if not 0.0 <= self.kv_host_gib < float("inf"):
            raise ValueError(f"kv_host_gib must be a number of GiB >= 0 (0 = no host tier), got {self.kv_host_gib}")
        if self.kv_disk_gib is not None and not 0.0 < self.kv_disk_gib < float("inf"):
            raise ValueError(f"kv_disk_gib must be a positive number of GiB, got {self.kv_disk_gib}")
        if (self.kv_disk_dir is None) != (self.kv_disk_gib is None):
            raise ValueError("kv_disk_dir and kv_disk_gib go together (the disk tier's folder and its size)")
        if self.kv_disk_dir is not None and not self.kv_host_gib:
            raise ValueError("kv_disk_dir needs kv_host_gib: blocks pass through the host tier on their way to disk")
        if not self.kv_host_gib:
            return
        if not self.enable_prefix_caching:
            raise ValueError("kv_host_gib extends the prefix cache: not with enable_prefix_caching off")
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_host_gib: the host and disk tiers do not run with tensor parallelism yet (each rank "
                             "holds its own share of every block)")

    @property
    def lora_shrink_used(self) -> str:
        """lora_shrink with "auto" resolved."""
        if self.lora_shrink != "auto":
            return self.lora_shrink
        return "chunks" if self.batch_invariant else "gemm"

    def _check_loras(self) -> None:
        if self.lora_shrink not in LORA_SHRINKS:
            raise ValueError(f"lora_shrink must be one of {LORA_SHRINKS}, got {self.lora_shrink!r}")
        if self.lora_shrink not in ("auto", "chunks") and self.batch_invariant:
            raise ValueError(f"lora_shrink={self.lora_shrink!r} is not batch-invariant (the library GEMM's sums "
                             "depend on the batch): leave it 'chunks' with batch_invariant")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        names = [name for name, _ in self.loras]
        if len(set(names)) != len(names):
            raise ValueError(f"loras: an adapter name given twice: {names}")
        if not self.max_loras:
            if self.loras:
                raise ValueError("loras are given but max_loras is 0: give the adapters GPU slots (max_loras >= 1)")
            return
        if self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters do not run with tensor parallelism yet (their weights are not sharded): "
                             "leave out max_loras or tensor_parallel_size")
        if self.speculative is not None:
            raise ValueError("LoRA adapters do not run with speculative decoding yet (the proposals would not come "
                             "from the adapted model): leave out max_loras or speculative")

    def _check_speculative(self) -> None:
        if self.speculative is None:
            if self.draft_model is not None:
                raise ValueError("draft_model is given but speculative decoding is off: add speculative='draft'")
            return
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("speculative='draft' needs draft_model (a model folder), and only it takes one")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.speculative_max_batch < 1:
            raise ValueError("speculative_max_batch must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding does not run with tensor parallelism yet: "
                             "leave out speculative or tensor_parallel_size")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
