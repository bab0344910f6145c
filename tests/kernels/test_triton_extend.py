"""The Triton paged extend kernel against `kernels.reference.paged_attention` (float32).

Runs in Triton's CPU interpreter when there is no GPU (shapes kept tiny: the interpreter costs
~7 ms per program per KV tile). Fresh random inputs every run, drawn from the `gen` fixture
(tests/kernels/conftest.py); block tables shuffled; cache slots nobody wrote are poisoned (NaN / NaN
scales), as is the output before the launch.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest  # noqa: E402

from pie.kernels import reference as ref  # noqa: E402
from pie.kernels.triton_extend import paged_extend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Batch:
    """B sequences in a paged cache with shuffled pages, plus their packed new queries.

    `clean` caches hold zeros in slots nobody wrote (the reference's input); the kernel reads the
    `poisoned` copies, where those slots are NaN (float) or have NaN scales (int8)."""

    def __init__(self, seq_lens: list[int], q_lens: list[int], *, gen: torch.Generator, block_size: int, hkv: int,
                 group: int, d: int, cache_dtype: torch.dtype,
                 q_dtype: torch.dtype = torch.float32, new_kv: bool = False, window: int | None = None):
        assert all(1 <= lq <= s for s, lq in zip(seq_lens, q_lens))
        self.seq_lens, self.q_lens, self.hq, self.d = seq_lens, q_lens, hkv * group, d
        pages = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(pages) + 3  # a few pages nobody owns
        shape = (num_blocks, block_size, hkv, d)
        self.k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
        self.v_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
        self.k_scale = self.v_scale = None
        if cache_dtype == torch.int8:
            self.k_scale = torch.zeros(num_blocks, hkv, block_size, dtype=torch.float16, device=DEVICE)
            self.v_scale = torch.zeros(num_blocks, hkv, block_size, dtype=torch.float16, device=DEVICE)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables = torch.full((len(seq_lens), max(pages) + 2), -1, dtype=torch.int32)
        written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        new_slots = []  # cache slots of the new tokens
        for i, (s, n) in enumerate(zip(seq_lens, pages)):
            table = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
            self.block_tables[i, :n] = table
            pos = torch.arange(s)
            slots = table[pos // block_size].long() * block_size + pos % block_size
            written[slots] = True
            new_slots.append(slots[s - q_lens[i]:])
            k, v = (torch.randn(s, hkv, d, generator=gen).to(DEVICE) for _ in range(2))
            ref.write_kv_cache(k, v, self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                               slots.to(DEVICE))
        self.block_tables = self.block_tables.to(DEVICE)
        self.poisoned = [t.clone() if t is not None else None
                         for t in (self.k_cache, self.v_cache, self.k_scale, self.v_scale)]
        unused = ~written.to(DEVICE)
        self.k_new = self.v_new = None
        self.window = window
        if new_kv:
            # The new tokens' own K/V, other values than their cached copies, which the kernel
            # must not read (poisoned below); K a slice of a fused buffer, as a qkv output gives.
            t = sum(q_lens)
            kv = torch.randn(t, 3, hkv, d, generator=gen).to(DEVICE, q_dtype)
            self.k_new = kv[:, 0]  # a slice of a fused buffer
            self.v_new = torch.randn(t, hkv, d, generator=gen).to(DEVICE, q_dtype)  # contiguous: other strides
            unused[torch.cat(new_slots).to(DEVICE)] = True
        for cache in self.poisoned[:2]:
            flat = cache.view(num_blocks * block_size, hkv, d)
            flat[unused] = 99 if cache_dtype == torch.int8 else float("nan")
        for scale in self.poisoned[2:]:
            if scale is not None:
                scale.transpose(1, 2)[unused.view(num_blocks, block_size)] = float("nan")
        self.q = torch.randn(sum(q_lens), self.hq, d, generator=gen).to(DEVICE, q_dtype)
        self.query_start_loc = torch.tensor([0] + q_lens).cumsum(0).int().to(DEVICE)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.scale = d ** -0.5

    def expected(self) -> torch.Tensor:
        return ref.paged_attention(self.q.float(), self.k_cache, self.v_cache, self.k_scale,
                                   self.v_scale, self.block_tables, self.seq_lens_t,
                                   self.query_start_loc, self.scale, window=self.window,
                                   k_new=None if self.k_new is None else self.k_new.float(),
                                   v_new=None if self.v_new is None else self.v_new.float())

    def run(self, q: torch.Tensor | None = None, **kw) -> torch.Tensor:
        q = self.q if q is None else q
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
        got = paged_extend(q, *self.poisoned, self.block_tables, self.seq_lens_t,
                           self.query_start_loc, self.scale, max_query_len=max(self.q_lens),
                           k_new=self.k_new, v_new=self.v_new, window=self.window, out=out, **kw)
        assert got is out
        assert not bool(out.isnan().any()), "output not fully written (or NaN)"
        return out


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want.double()).abs().max() / want.double().abs().max())


# (seq_lens, q_lens): lengths off block multiples throughout.
SHAPES = {
    "prefill": ([37, 21], [37, 21]),  # no cached prefix
    "chunked": ([70, 45], [19, 6]),  # a chunk after a cached prefix
    "mixed": ([40, 3, 66, 1, 25], [1, 3, 17, 1, 25]),  # q_len 1 rows, prefill and chunk packed
    "long_prefix": ([150, 9], [10, 9]),  # several unmasked prefix tiles before the diagonal
}
# (group, head dim, block size, cache dtype, Hkv)
CONFIGS = [
    (1, 64, 16, torch.float32, 2),
    (4, 128, 32, torch.int8, 2),
    (8, 64, 16, torch.int8, 1),
    (4, 64, 16, torch.float16, 2),
    (8, 128, 32, torch.float32, 1),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"g{c[0]}-d{c[1]}-bs{c[2]}-{c[3]}")
def test_extend_matches_reference(shape: str, config, gen) -> None:
    group, d, block_size, cache_dtype, hkv = config
    batch = Batch(*SHAPES[shape], gen=gen, block_size=block_size, hkv=hkv, group=group, d=d,
                  cache_dtype=cache_dtype)
    out = batch.run()
    # fp32 operands on the interpreter; tf32 is not used (input_precision="ieee").
    assert rel_err(out, batch.expected()) <= 2e-5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: f"g{c[0]}-d{c[1]}-bs{c[2]}-{c[3]}")
def test_extend_new_kv_matches_reference(shape: str, config, gen) -> None:
    """The new tokens' K/V read as computed (k_new/v_new), their cached copies poisoned."""
    group, d, block_size, cache_dtype, hkv = config
    batch = Batch(*SHAPES[shape], gen=gen, block_size=block_size, hkv=hkv, group=group, d=d,
                  cache_dtype=cache_dtype, new_kv=True)
    assert rel_err(batch.run(), batch.expected()) <= 2e-5


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("new_kv", [False, True])
def test_extend_sliding_window(window: int, new_kv: bool, gen) -> None:
    batch = Batch([70, 45, 9, 30], [19, 45, 1, 7], gen=gen, block_size=16, hkv=2, group=2, d=32,
                  cache_dtype=torch.int8, new_kv=new_kv, window=window)
    assert rel_err(batch.run(), batch.expected()) <= 2e-5


@pytest.mark.parametrize("d", [48, 80, 96, 112, 256])
@pytest.mark.parametrize("new_kv", [False, True])
def test_extend_head_dims_not_a_power_of_two(d: int, new_kv: bool, gen) -> None:
    """Head dims of real checkpoints that are not powers of two, up to 256: padded tiles."""
    batch = Batch([37, 20], [9, 20], gen=gen, block_size=16, hkv=1, group=2, d=d, cache_dtype=torch.int8,
                  new_kv=new_kv)
    assert rel_err(batch.run(), batch.expected()) <= 2e-5


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64), (128, 32)])
def test_extend_tile_shapes(block_m: int, block_n: int, gen) -> None:
    """Tiles smaller and larger than a page, one token per q-block (block_m 16 at G 16)."""
    batch = Batch([45, 29, 2], [12, 29, 1], gen=gen, block_size=32, hkv=1,
                  group=16 if block_m == 16 else 4, d=64, cache_dtype=torch.int8)
    out = batch.run(block_m=block_m, block_n=block_n)
    assert rel_err(out, batch.expected()) <= 2e-5


# (k_mode, v_mode) of the int8 cached tiles without k_new (triton_tile.int8_scores / int8_pv): K read
# as 1152 + K or on int8 tensor cores (q in two int8 terms), V read as 1152 + V or cast.
INT8_MODES = [("bias", "bias"), ("imma", "bias"), ("imma", "cast"), ("cast", "bias")]


@pytest.mark.parametrize("modes", INT8_MODES, ids=lambda m: f"k{m[0]}-v{m[1]}")
@pytest.mark.parametrize("shape", ["prefill", "mixed"])
def test_extend_int8_modes(modes, shape: str, gen) -> None:
    batch = Batch(*SHAPES[shape], gen=gen, block_size=16, hkv=2, group=4, d=64, cache_dtype=torch.int8)
    # the 1152 offsets cost fp32 ~1e-4 of cancellation; q in two int8 terms ~1e-5
    assert rel_err(batch.run(int8_modes=modes), batch.expected()) <= 1e-3
    with pytest.raises(AssertionError, match="without k_new"):
        Batch(*SHAPES[shape], gen=gen, block_size=16, hkv=2, group=4, d=64, cache_dtype=torch.int8,
              new_kv=True).run(int8_modes=modes)


@pytest.mark.parametrize("cache_dtype,modes", [(torch.int8, None), (torch.int8, ("imma", "bias")),
                                               (torch.int8, ("bias", "bias")), (torch.float32, None)], ids=str)
def test_extend_chunks_give_the_same_bits(cache_dtype, modes, gen) -> None:
    """Every key read as stored (no k_new), tiles at fixed key positions: a prompt attended whole
    and the same prompt in chunks (each chunk after its cached prefix) give each query the same
    bits, given the same max_query_len (hence the same tile shapes), in every int8 mode. The int8
    modes scale P per row (a per-tile max of the V scales changed with the keys a chunk's last tile
    loads); the kernel runs without FMA fusion (paged_extend's docstring: with it, whole and
    masked tiles rounded a score differently). Under Triton's interpreter a tile's dot is numpy's
    matmul, whose BLAS rounds a row differently with other rows beside it (numpy 2.4.6: by ~1e-5,
    2026-12-02): there the chunks are held to float rounding; the bits are the compiled kernel's."""
    n, chunk = 45, 13
    whole = Batch([n], [n], gen=gen, block_size=16, hkv=2, group=2, d=32, cache_dtype=cache_dtype)
    want = whole.run(int8_modes=modes)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        q = whole.q[lo:hi]
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
        paged_extend(q, *whole.poisoned, whole.block_tables, torch.tensor([hi], dtype=torch.int32, device=DEVICE),
                     torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE), whole.scale, max_query_len=n,
                     out=out, int8_modes=modes)
        if DEVICE != "cuda":
            assert (out.float() - want[lo:hi].float()).abs().max() <= 1e-4, f"chunk [{lo}, {hi})"
        else:
            assert torch.equal(out, want[lo:hi]), f"chunk [{lo}, {hi}) differs from the whole prompt"


def test_extend_strided_half_q(gen) -> None:
    """fp16 q as a slice of a fused qkv buffer (row stride past Hq * D); output in fp16."""
    batch = Batch([30, 18], [11, 18], gen=gen, block_size=16, hkv=2, group=2, d=64,
                  cache_dtype=torch.float16, q_dtype=torch.float16)
    t, hq, d = batch.q.shape
    fused = torch.randn(t, (hq + 4) * d, generator=gen).to(DEVICE, torch.float16)
    fused[:, : hq * d] = batch.q.reshape(t, hq * d)
    q = fused[:, : hq * d].view(t, hq, d)
    assert not q.is_contiguous()
    out = batch.run(q=q)
    assert out.dtype == torch.float16
    # fp16 output rounding; on the GPU P and the dots are fp16 too.
    assert rel_err(out, batch.expected()) <= (2e-3 if DEVICE == "cpu" else 1e-2)


def test_extend_rejects_bad_inputs(gen) -> None:
    batch = Batch([20], [4], gen=gen, block_size=16, hkv=2, group=2, d=64, cache_dtype=torch.int8)
    args = (batch.block_tables, batch.seq_lens_t, batch.query_start_loc, batch.scale)
    with pytest.raises(AssertionError):  # int8 cache without scales
        paged_extend(batch.q, batch.k_cache, batch.v_cache, None, None, *args, max_query_len=4)
    with pytest.raises(AssertionError):  # Hq not a multiple of Hkv
        paged_extend(batch.q[:, :3], *batch.poisoned, *args, max_query_len=4)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 96, 256])
@pytest.mark.parametrize("new_kv", [False, True])
def test_extend_gpu_bf16(cache_dtype: torch.dtype, d: int, new_kv: bool, gen) -> None:
    """bf16 queries on the GPU (bf16 dots) against the fp32 reference: bf16-level error."""
    batch = Batch([1000, 517, 300, 77, 1], [1000, 130, 1, 77, 1], gen=gen, block_size=16, hkv=8,
                  group=4, d=d, cache_dtype=cache_dtype, q_dtype=torch.bfloat16, new_kv=new_kv)
    out = batch.run()
    assert rel_err(out, batch.expected()) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2)])
@pytest.mark.parametrize("modes", [("imma", "bias"), ("bias", "bias")], ids=str)
@pytest.mark.parametrize("d", [128])
def test_extend_gpu_int8_tiles(tiles, modes, d: int, gen) -> None:
    """The int8 tile shapes and modes benchmarks/extend_check.py times, every key from the pages."""
    batch = Batch([1000, 517, 300, 77, 1], [1000, 130, 1, 77, 1], gen=gen, block_size=16, hkv=8, group=4, d=d,
                  cache_dtype=torch.int8, q_dtype=torch.bfloat16)
    bm, bn, w, st = tiles
    out = batch.run(block_m=bm, block_n=bn, num_warps=w, num_stages=st, int8_modes=modes)
    assert rel_err(out, batch.expected()) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.bfloat16])
def test_extend_gpu_chunks_give_the_same_bits(cache_dtype, gen) -> None:
    """As test_extend_chunks_give_the_same_bits, on the GPU's tensor cores: chunks of 64, 100 and
    1 token against the whole 1000-token prompt (int8 pages failed this 3 runs in 4 while the
    kernel fused multiplies into adds)."""
    n = 1000
    whole = Batch([n], [n], gen=gen, block_size=16, hkv=8, group=4, d=128, cache_dtype=cache_dtype, q_dtype=torch.bfloat16)
    want = whole.run()
    for chunk in (64, 100, 1):
        for lo in (0, 300, 999) if chunk > 1 else (5, 998):
            hi = min(n, lo + chunk)
            q = whole.q[lo:hi]
            out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
            paged_extend(q, *whole.poisoned, whole.block_tables,
                         torch.tensor([hi], dtype=torch.int32, device=DEVICE),
                         torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE), whole.scale, max_query_len=n,
                         out=out)
            diff = (out.float() - want[lo:hi].float()).abs().max().item()
            assert torch.equal(out, want[lo:hi]), f"chunk [{lo}, {hi}) differs by up to {diff:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("new_kv", [False, True])
def test_extend_gpu_sliding_window(new_kv: bool, gen) -> None:
    batch = Batch([1000, 517, 300, 1], [1000, 130, 1, 1], gen=gen, block_size=16, hkv=8, group=4, d=128,
                  cache_dtype=torch.int8, q_dtype=torch.bfloat16, new_kv=new_kv, window=256)
    assert rel_err(batch.run(), batch.expected()) <= 2e-2
