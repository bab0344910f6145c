"""The attention backend handed to the model: writes each layer's new K/V into the paged KV pool
(engine/runner/kv_cache.py), then attends from it.

Per step the runner fills `AttentionMetadata` for the packed batch (engine/runner/staging.py; the
layout: engine/runner/step_layout.py). For sequence i:

    |<------------- seq_lens[i] (tokens in the cache after this step's write) ------------->|
    |<------ already computed (num_computed_tokens) ------>|<--- query_len_i (new) --->|

The new tokens' K/V are written to their slots first, then their queries attend to all
`seq_lens[i]` cached tokens causally, reading every key and value as stored.

One answer per seed: what attention reads must not depend on whether a token's K/V were computed
in this step or come back from the cache (a cached prefix, an earlier chunk, a recompute after
preemption), or a seeded request changes its tokens when its prefix happens to be cached. So a
prefill attends to its own new tokens' K/V as the cache stores them (an int8 cache: rounded), and
it may take them from the step's tensors instead of the pages only where the cache holds them
exactly (same dtype as the model's activations, or fp32): the same values, read faster.

The ops behind it are chosen once: `TorchOps` (kernels.reference, the CPU path) or `TritonOps`
(the Triton kernels; CUDA, or the CPU under Triton's interpreter in tests), with one signature.
On CUDA, prompt work goes through kernels/flash_prefill.py where it applies (bf16/fp16 models,
head dims a multiple of 8, outside graph capture): keys gathered from the pages, then
FlashAttention's varlen kernel; the Triton extend kernel serves the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pie.kernels import reference

from ..config import ATTENTION_BACKENDS
from .kv_cache import KVCache

# The extend kernel sizes its query tiles by the step's longest chunk (short chunks, fewer padded
# rows); the batch-invariant mode gives it this bound instead, above any chunk, so the tiles are the
# launch table's whatever the step holds.
INVARIANT_QUERY_LEN = 1 << 20


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each new token; -1 = padding, not written
    block_tables: torch.Tensor  # (B, max_blocks) int32: physical block ids per sequence, padded
    seq_lens: torch.Tensor  # (B,) int32: tokens in the cache per sequence after this step's write
    query_start_loc: torch.Tensor  # (B + 1,) int32: sequence i owns queries [qsl[i], qsl[i+1])
    max_query_len: int  # longest query run in the batch (1 = pure decode)
    max_seq_len: int  # longest seq_lens entry (host copy, so kernels size their grids without a sync)
    # The first num_decodes sequences have one query each and attend like a pure decode step (the
    # scheduler puts running decodes first); B in a pure decode step. 0: none (every row extends).
    num_decodes: int = 0
    decode_max_seq_len: int = 0  # longest seq_lens entry among those (host copy)
    # (B - num_decodes + 1,) int32: query_start_loc of the other sequences, rebased to 0; set when
    # a step mixes the two, else None.
    prefill_query_start_loc: torch.Tensor | None = None
    # Keys in the cache of the sequences that are not decodes (sum of their seq_lens; host copy):
    # what the prefill path gathers from the pages. 0 where unknown (verify steps), which keeps
    # those steps on the Triton extend kernel.
    prefill_kv_tokens: int = 0
    # (B - num_decodes + 1,) int32: where each of those sequences' keys start once gathered (the
    # cumulative sums of their seq_lens from 0), staged with the step; None: summed where needed.
    prefill_key_start_loc: torch.Tensor | None = None

    @property
    def decodes_only(self) -> bool:
        """Every sequence attends as a decode (a pure decode step, or its graph)."""
        return self.num_decodes == self.seq_lens.shape[0]


# One layer's (k_cache, v_cache, k_scale, v_scale); the scales only for int8 caches.
_Cache = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass(slots=True)
class _Parts:
    """A mixed step's block tables and lengths, split into its running decodes and the rest."""

    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefill_tables: torch.Tensor
    prefill_lens: torch.Tensor


class TorchOps:
    """The torch reference ops (kernels.reference): the CPU path."""

    write = staticmethod(reference.write_kv_cache)

    @staticmethod
    def decode(q, cache: _Cache, block_tables, seq_lens, scale: float, *, max_seq_len: int, window: int | None,
               out: torch.Tensor | None) -> torch.Tensor:
        res = reference.paged_attention_decode(q, *cache, block_tables, seq_lens, scale, window=window)
        return res if out is None else out.copy_(res)

    @staticmethod
    def extend(q, k_new, v_new, cache: _Cache, block_tables, seq_lens, query_start_loc, scale: float, *,
               max_query_len: int, max_seq_len: int, kv_tokens: int, key_start_loc: torch.Tensor | None,
               window: int | None, out: torch.Tensor | None) -> torch.Tensor:
        res = reference.paged_attention(q, *cache, block_tables, seq_lens, query_start_loc, scale,
                                        max_query_len=max_query_len, k_new=k_new, v_new=v_new, window=window)
        return res if out is None else out.copy_(res)


class TritonOps:
    """The Triton kernels (imported only when chosen, so the CPU path never needs triton)."""

    def __init__(self, head_dim: int, max_model_len: int | None, batch_invariant: bool = False) -> None:
        from pie.kernels import flash_prefill, triton_cache_write, triton_decode, triton_extend

        if head_dim > triton_decode.MAX_HEAD_DIM or head_dim % 2:
            raise ValueError(
                f"head dim {head_dim}: the Triton attention kernels serve even head dims up to "
                f"{triton_decode.MAX_HEAD_DIM}; use --attention-backend torch (the reference path) for this model")
        self.write = triton_cache_write.write_kv_cache
        self._decode = triton_decode.paged_decode
        self._extend = triton_extend.paged_extend
        self._flash = flash_prefill
        self._fixed_split_tokens = triton_decode.fixed_split_tokens
        self._sm_count = triton_decode.sm_count
        self.max_model_len = max_model_len
        # The batch-invariant mode (EngineConfig.batch_invariant): decode splits at fixed key
        # positions in every batch, and prompt work through the extend kernel alone, its tiles the
        # launch table's (never shrunk for a step of short chunks) and every key read from the pages.
        self.batch_invariant = batch_invariant
        self._invariant_split = triton_decode.invariant_split_tokens(max_model_len or 1)

    def decode(self, q, cache: _Cache, block_tables, seq_lens, scale: float, *, max_seq_len: int,
               window: int | None, out: torch.Tensor | None) -> torch.Tensor:
        # Splits at fixed key positions for a batch of sequences with contexts up to 16k: a ragged
        # batch keeps the SMs busy, and a sequence's decode is the same bits in a graph, an eager
        # mixed step or any batch of that kind (None: the split count set by the batch).
        split = None
        if self.batch_invariant:
            split = self._invariant_split
        elif self.max_model_len is not None:
            sms = self._sm_count(q.device) if q.is_cuda else 1
            split = self._fixed_split_tokens(self.max_model_len, q.shape[0], cache[0].shape[2], sms)
        return self._decode(q, *cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len, window=window, out=out,
                            split_tokens=split, batch_invariant=self.batch_invariant)

    def extend(self, q, k_new, v_new, cache: _Cache, block_tables, seq_lens, query_start_loc, scale: float, *,
               max_query_len: int, max_seq_len: int, kv_tokens: int, key_start_loc: torch.Tensor | None,
               window: int | None, out: torch.Tensor | None) -> torch.Tensor:
        # FlashAttention over the keys gathered from the pages where it applies and the copy is not
        # too large (kernels/flash_prefill.py), else the Triton extend kernel.
        if self.batch_invariant:  # tiles at fixed key positions, of one shape: a query's bits are its own
            k_new = v_new = None
            max_query_len = INVARIANT_QUERY_LEN
        elif (kv_tokens and self._flash.fits(kv_tokens, cache[0].shape[2], cache[0].shape[3], q.dtype)
                and self._flash.supported(q)):
            return self._flash.paged_prefill(q, *cache, block_tables, seq_lens, query_start_loc, scale,
                                             max_query_len=max_query_len, max_seq_len=max_seq_len,
                                             kv_tokens=kv_tokens, key_start_loc=key_start_loc, window=window,
                                             out=out)
        return self._extend(q, *cache, block_tables, seq_lens, query_start_loc, scale, max_query_len=max_query_len,
                            k_new=k_new, v_new=v_new, window=window, out=out)


class PagedAttention:
    """Attention backend handed to the model: writes each layer's new K/V into the paged cache,
    then attends from the cache.

    `impl`: "triton" (CUDA: the Triton cache-write, decode and extend kernels), "torch" (the
    reference ops in kernels.reference; the CPU path), "auto" = triton on CUDA, torch elsewhere.
    "triton" on CPU tensors works only under Triton's interpreter (TRITON_INTERPRET=1, tests).

    Prefill work attends to every key as stored (the module docstring: one answer per seed),
    taking the new tokens' K/V from the step's tensors where the cache stores them exactly; decodes
    (a pure decode step, or the running decodes a mixed step begins with) read everything from the
    cache through the decode kernel. `windows[i]`: layer i's sliding window (None: all keys).
    `max_model_len`: the longest context the decode will see, which sets its fixed splits (the
    Triton path; None: the batch-dependent split count).
    """

    def __init__(self, kv_cache: KVCache, softmax_scale: float, impl: str = "auto",
                 windows: list[int | None] | None = None, max_model_len: int | None = None,
                 batch_invariant: bool = False) -> None:
        if impl not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {impl!r}")
        if impl == "auto":
            impl = "triton" if kv_cache.k.is_cuda else "torch"
        if batch_invariant and impl != "triton":
            raise ValueError("batch_invariant runs the Triton kernels: it needs CUDA (on the CPU, "
                             "attention_backend='triton' under Triton's interpreter, as the tests run it)")
        self.impl = impl
        self.kv_cache = kv_cache
        self.softmax_scale = softmax_scale
        self.windows = list(windows) if windows is not None else [None] * kv_cache.num_layers
        if len(self.windows) != kv_cache.num_layers:
            raise ValueError(f"{len(self.windows)} windows for {kv_cache.num_layers} layers")
        self._metadata: AttentionMetadata | None = None
        self._parts: _Parts | None = None
        self.ops: TorchOps | TritonOps = (TritonOps(kv_cache.k.shape[-1], max_model_len, batch_invariant)
                                          if impl == "triton" else TorchOps())

    @property
    def metadata(self) -> AttentionMetadata | None:
        """The step's attention metadata (set by the runner before the forward pass, None after)."""
        return self._metadata

    @metadata.setter
    def metadata(self, md: AttentionMetadata | None) -> None:
        # A mixed step's two parts are views of the step's tensors, the same for every layer: taken
        # once here, not in each layer's call (a mixed step's attention runs eagerly, so its host
        # work per layer is time the GPU may wait).
        self._metadata = md
        self._parts = None
        if md is not None and md.prefill_query_start_loc is not None:
            nd = md.num_decodes
            self._parts = _Parts(md.block_tables[:nd], md.seq_lens[:nd], md.block_tables[nd:], md.seq_lens[nd:])

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        # q: (T, Hq, D); k, v: (T, Hkv, D) -> (T, Hq, D), written into `out` when given (the static
        # buffer of piecewise graphs, engine/runner/cuda_graphs.py)
        md = self.metadata
        assert md is not None, "attention metadata must be set before the forward pass"
        ops, scale = self.ops, self.softmax_scale
        k_cache, v_cache, k_scale, v_scale = self.kv_cache.layer(layer_idx)
        window = self.windows[layer_idx]
        ops.write(k, v, k_cache, v_cache, k_scale, v_scale, md.slot_mapping)
        cache = (k_cache, v_cache, k_scale, v_scale)
        if md.decodes_only:  # one query per sequence: everything from the cache
            return ops.decode(q, cache, md.block_tables, md.seq_lens, scale, max_seq_len=md.max_seq_len,
                              window=window, out=out)
        k_new, v_new = (k, v) if self.holds_exactly(k.dtype) else (None, None)  # else the pages' copies
        if md.prefill_query_start_loc is None:
            return ops.extend(q, k_new, v_new, cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
                              max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
                              kv_tokens=md.prefill_kv_tokens, key_start_loc=md.prefill_key_start_loc,
                              window=window, out=out)
        # A mixed step: its running decodes (first) as in a decode step, the rest as a prefill.
        nd, parts = md.num_decodes, self._parts
        assert parts is not None
        if out is None:
            out = torch.empty_like(q)
        ops.decode(q[:nd], cache, parts.decode_tables, parts.decode_lens, scale, max_seq_len=md.decode_max_seq_len,
                   window=window, out=out[:nd])
        ops.extend(q[nd:], None if k_new is None else k_new[nd:], None if v_new is None else v_new[nd:], cache,
                   parts.prefill_tables, parts.prefill_lens, md.prefill_query_start_loc, scale,
                   max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, kv_tokens=md.prefill_kv_tokens,
                   key_start_loc=md.prefill_key_start_loc, window=window, out=out[nd:])
        return out

    def holds_exactly(self, dtype: torch.dtype) -> bool:
        """The cache stores K/V computed in `dtype` without changing them: the pages' dtype, or fp32."""
        return self.kv_cache.k.dtype in (dtype, torch.float32)
