"""What EngineCore builds beside the model and its pool: the kernels the model runs on, the K/V
smoothing folded into the weights before int8 pages quantize anything, and speculative decoding's
`Speculator` (with the draft model's runner over a pool of its own)."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path

import structlog
import torch

from pie.model import smoothing
from pie.model.config import ModelConfig
from pie.model.llama import LlamaForCausalLM
from pie.model.lora import AdapterError, LoraBank
from pie.model.tokenizer import Tokenizer

from ..config import EngineConfig
from ..errors import StartupError
from ..messages import AdapterCommand, AdapterReply, AdapterState
from ..offload.copier import BlockLayout
from ..offload.disk import DiskIdentity, model_fingerprint
from ..offload.tiers import KVTiers
from ..runner.kv_cache import KVCache
from ..runner.model_runner import ModelRunner
from ..runner.tensor_parallel import Leader
from ..runner.warm_up import warm_up
from ..scheduling.adapters import Adapter, AdapterNotFoundError, Adapters
from ..scheduling.block_manager import BlockManager
from ..spec_decode.draft import DraftModel, DraftProposer
from ..spec_decode.speculator import NgramProposer, Proposer, Speculator

log = structlog.get_logger(__name__)


def use_kernels(model: LlamaForCausalLM, config: EngineConfig, device: torch.device) -> None:
    """On CUDA, one Triton kernel per norm / SwiGLU / RoPE (kernels/triton_fused.py). In the
    batch-invariant mode (which runs the Triton path, on CUDA or under Triton's interpreter) those
    too, and every projection through kernels/triton_matmul.py, whose rows do not depend on the
    step's other rows (cuBLAS picks its kernel by the row count)."""
    if device.type == "cuda" or config.batch_invariant:
        from pie.kernels import triton_fused

        model.use_fused_ops(triton_fused)
    if config.batch_invariant:
        from pie.kernels import triton_matmul

        model.use_batch_invariant(triton_matmul.linear)


def make_adapters(model: LlamaForCausalLM, config: EngineConfig, device: torch.device,
                  factors: smoothing.KVSmoothing | None) -> Adapters | None:
    """The LoRA slots `config` asks for (None: max_loras 0), hooked into `model`, with the adapters
    it names loaded (AdapterError, naming one, when it cannot be served). K/V smoothing already
    folded into the weights (`factors`) is folded into every adapter too. Made before the KV pool is
    sized, which then counts the slots' memory as taken."""
    if not config.max_loras:
        return None
    mc = model.config
    triton_path = device.type == "cuda" or config.attention_backend == "triton"
    bank = LoraBank(mc, config.max_loras, config.max_lora_rank, model.embed_tokens.weight.dtype, device,
                    max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),  # a step's rows at most
                    wide_b=triton_path and config.lora_shrink_used == "masked")
    if factors is not None:
        bank.fold_smoothing(factors.k, factors.v)
    from pie.kernels import triton_lora

    if triton_path:
        bank.attach(model, partial(triton_lora.lora_delta_, shrink=config.lora_shrink_used))
    else:
        bank.attach(model, triton_lora.lora_delta_reference_)
    adapters = Adapters(bank, mc)
    for name, folder in config.loras:
        try:
            adapters.load(name, folder)
        except AdapterError as e:
            raise StartupError(f"--lora {name}={folder}: {e.reason}") from None
    log.info("lora_slots", slots=config.max_loras, max_rank=config.max_lora_rank,
             bytes=LoraBank.nbytes(mc, config.max_loras, config.max_lora_rank, model.embed_tokens.weight.dtype),
             loaded=adapters.names())
    return adapters


def resolve_adapter(adapters: Adapters | None, name: str | None) -> Adapter | None:
    """The loaded adapter a request names (None: the base model); AdapterNotFoundError."""
    if name is not None and adapters is None:
        raise AdapterNotFoundError(name, "not loaded (this engine has no adapter slots: max_loras is 0)")
    return None if adapters is None else adapters.resolve(name)


def adapter_command(adapters: Adapters | None, cmd: AdapterCommand) -> AdapterReply:
    """Applies a load (cmd.path given) or an unload of a LoRA adapter; its reply."""
    try:
        if adapters is None:
            raise AdapterError(cmd.name, "this server has no adapter slots (start it with --max-loras N)")
        if cmd.path is None:
            adapters.unload(cmd.name)
        else:
            adapters.load(cmd.name, cmd.path)
    except AdapterNotFoundError as e:
        return AdapterReply(cmd.command_id, e.reason, not_found=True)
    except AdapterError as e:
        return AdapterReply(cmd.command_id, e.reason)
    return AdapterReply(cmd.command_id)


def adapter_states(adapters: Adapters | None, waiting) -> list[AdapterState]:
    """Every loaded adapter and how many requests run and wait on it (EngineStats.adapters)."""
    if adapters is None:
        return []
    queued = Counter(r.adapter.name for r in waiting if r.adapter is not None and not r.adapter.unloaded)
    return [AdapterState(i.name, i.path, i.rank, i.resident, i.running, queued.get(i.name, 0)) for i in adapters.info()]


def spec_stats(speculator: Speculator | None) -> dict:
    """Speculative decoding's counters for EngineStats (none when it is off)."""
    if speculator is None:
        return {}
    s = speculator.stats
    return dict(spec_num_drafts=s.num_drafts, spec_num_draft_tokens=s.num_draft_tokens,
                spec_num_accepted_tokens=s.num_accepted_tokens, spec_accepted_per_pos=list(s.accepted_per_pos))


def smooth_kv(model: LlamaForCausalLM, mc: ModelConfig, tokenizer: Tokenizer, tp: Leader | None,
              config: EngineConfig) -> smoothing.KVSmoothing | None:
    """Evens out K/V channel magnitudes of `model` (its config `mc`) before anything is quantized
    (model/smoothing.py), for int8 pages unless config.kv_smoothing is "off" (None then); with
    "auto", in the layers and kv heads where that lowers the int8 attention error."""
    if config.kv_cache_dtype != "int8" or config.kv_smoothing == "off":
        return None
    mode = config.kv_smoothing
    ids = smoothing.calibration_tokens(tokenizer.encode, mc.vocab_size, min(256, mc.max_model_len))
    if tp is not None:
        tp.calibrate(ids)  # the calibration pass is collective: every rank runs it
    factors = smoothing.calibrate(model, ids, choose=mode == "auto")
    smoothing.fold(model, factors)
    low, high = factors.log2_range()
    k_heads, v_heads, heads = factors.heads_smoothed()
    errors = {}  # what the choice measured (auto): the int8 attention error without and with the factors kept
    if factors.error_plain is not None and factors.error_kept is not None:
        errors = dict(int8_error_plain=round(factors.error_plain, 6), int8_error_kept=round(factors.error_kept, 6))
    log.info("kv_smoothing", mode=mode, calibration_tokens=len(ids),
             k_heads_smoothed=f"{k_heads}/{heads}", v_heads_smoothed=f"{v_heads}/{heads}",
             factor_min=2.0 ** low, factor_max=2.0 ** high, **errors)
    return factors


def make_speculator(config: EngineConfig, vocab_size: int, draft: DraftModel | None, device: torch.device,
                    max_model_len: int, num_blocks: int) -> Speculator | None:
    """Speculative decoding's proposals as `config` asks (None: off), for a target model of
    `vocab_size` whose pool has `num_blocks` blocks."""
    if config.speculative is None:
        return None
    proposer: Proposer
    if config.speculative == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        assert draft is not None
        proposer = DraftProposer(_draft_runner(config, draft, device, max_model_len, num_blocks), vocab_size)
    return Speculator(proposer, config.num_speculative_tokens, config.speculative_max_batch)


def _draft_runner(config: EngineConfig, draft: DraftModel, device: torch.device, max_model_len: int,
                  num_blocks: int) -> ModelRunner:
    """The draft model's runner over its own pool of `num_blocks` blocks (engine/spec_decode/draft.py),
    warmed up and its decode steps captured as the target's are."""
    mc = draft.model.config
    cache = KVCache(num_layers=mc.num_hidden_layers, num_blocks=num_blocks, block_size=config.block_size,
                    num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
                    kv_cache_dtype=config.kv_cache_dtype, device=device)
    runner = ModelRunner(draft.model, cache, vocab_size=mc.vocab_size, softmax_scale=mc.attn_scale,
                         device=device, attention_backend=config.attention_backend,
                         max_num_seqs=min(config.max_num_seqs, config.speculative_max_batch),
                         max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                         windows=[mc.layer_window(i) for i in range(mc.num_hidden_layers)])
    if device.type == "cuda":
        warm_up(runner)
        if not config.enforce_eager:
            runner.capture_cuda_graphs()
    return runner


def make_kv_tiers(config: EngineConfig, kv_cache: KVCache, block_manager: BlockManager, device: torch.device,
                  dtype_name: str) -> KVTiers | None:
    """The host and disk tiers below the pool (engine/offload/), attached to `block_manager`; None
    without --kv-host-gib. A disk file must match the identity made here to be served: the model's
    files and everything else that decides a block's stored bits."""
    if not config.kv_host_gib:
        return None
    identity = None
    if config.kv_disk_dir is not None:
        k = kv_cache.k
        facts = dict(dtype=dtype_name, kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size,
                     layout=[k.shape[0], *k.shape[2:]], kv_smoothing=config.kv_smoothing, device=device.type,
                     attention_backend=config.attention_backend, batch_invariant=config.batch_invariant)
        identity = DiskIdentity(fingerprint=model_fingerprint(config.model, **facts), model=Path(config.model).name,
                                dtype=dtype_name, kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size,
                                block_bytes=BlockLayout(kv_cache).block_bytes)
    return KVTiers(block_manager, kv_cache, device, host_bytes=int(config.kv_host_gib * 2**30),
                   disk_dir=config.kv_disk_dir, disk_bytes=int((config.kv_disk_gib or 0) * 2**30), identity=identity)
