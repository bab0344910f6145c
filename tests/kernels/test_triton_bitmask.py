"""The token-mask kernel (kernels/triton_bitmask.py) against its torch twin
(kernels.reference.apply_token_bitmask_), and the twin against a per-token Python reading of the
bits. Runs in Triton's CPU interpreter without a GPU (tiny shapes); fresh random masks each case."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest  # noqa: E402

from pie.kernels.reference import apply_token_bitmask_ as reference  # noqa: E402
from pie.kernels.triton_bitmask import apply_token_bitmask_ as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]  # the interpreter computes bf16 wrongly (it only stores here)


def random_bitmask(rng, num_masks: int, vocab: int, density: float) -> torch.Tensor:
    """(S, ceil(V/32)) int32 whose bits are set with probability `density`; bits past V random too
    (they must be ignored)."""
    words = -(-vocab // 32)
    bits = torch.rand(num_masks, words * 32, generator=rng) < density
    packed = (bits.view(num_masks, words, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """One token at a time: the bit of v in word v // 32, shift v % 32."""
    out = logits.clone()
    words = bitmask.tolist()
    for s, row in enumerate(rows):
        for v in range(logits.shape[1]):
            if not (words[s][v // 32] >> (v % 32)) & 1:
                out[row, v] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 100, 1024, 1100])
def test_reference_reads_the_bits_as_llguidance_lays_them_out(vocab, rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(5, vocab, generator=gen)
    rows = rng.sample(range(5), 3)
    mask = random_bitmask(gen, 3, vocab, 0.5)
    got = reference(logits.clone(), mask, torch.tensor(rows))
    assert torch.equal(got, expected(logits, mask, rows))


def test_reference_leaves_unnamed_rows_and_allowed_tokens_alone():
    logits = torch.arange(2 * 40, dtype=torch.float32).view(2, 40)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2 allowed
    mask[0, 1] = 1 << 3  # token 35
    out = reference(logits.clone(), mask, torch.tensor([1]))
    assert torch.equal(out[0], logits[0])
    allowed = torch.isfinite(out[1]).nonzero().squeeze(1).tolist()
    assert allowed == [0, 2, 35] and out[1, 35] == logits[1, 35]


@pytest.mark.parametrize("dtype", CPU_DTYPES if DEVICE == "cpu" else [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, batch, num_masks", [(100, 4, 2), (1024, 3, 3), (1500, 6, 4), (33, 1, 1)])
def test_kernel_matches_its_twin(vocab, batch, num_masks, dtype, rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    rows = rng.sample(range(batch), num_masks)
    for density in (0.0, 0.03, 0.5, 1.0):
        mask = random_bitmask(gen, num_masks, vocab, density)
        want = reference(logits.clone(), mask, torch.tensor(rows))
        got = kernel(logits.clone().to(DEVICE), mask.to(DEVICE), torch.tensor(rows, dtype=torch.int32, device=DEVICE))
        assert torch.equal(got.cpu(), want), f"density {density}"


def test_kernel_on_a_row_slice_with_a_stride_of_its_own(rng):
    """A CUDA graph's logits buffer is sliced to the batch: rows keep the buffer's stride."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    buffer = torch.randn(6, 80, generator=gen)
    view = buffer[:, :70]  # stride (80, 1): not contiguous
    mask = random_bitmask(gen, 2, 70, 0.3)
    want = reference(view.clone(), mask, torch.tensor([4, 1]))
    got_buffer = buffer.clone().to(DEVICE)
    kernel(got_buffer[:, :70], mask.to(DEVICE), torch.tensor([4, 1], device=DEVICE))
    assert torch.equal(got_buffer[:, :70].cpu(), want)
    assert torch.equal(got_buffer[:, 70:].cpu(), buffer[:, 70:]), "wrote past V"


def test_kernel_with_no_masks_does_nothing():
    logits = torch.randn(3, 64, device=DEVICE)
    before = logits.clone()
    kernel(logits, torch.empty(0, 2, dtype=torch.int32, device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("bad, message", [
    (dict(bitmask=torch.zeros(2, 3, dtype=torch.int32)), "words per row"),
    (dict(bitmask=torch.zeros(2, 4, dtype=torch.int64)), "int32"),
    (dict(rows=torch.tensor([0])), "rows must be"),
    (dict(rows=torch.tensor([0.0, 1.0])), "int32 or int64"),
    (dict(logits=torch.zeros(4, 100, dtype=torch.float64)), "fp32, bf16 or fp16"),
    (dict(logits=torch.zeros(100, 4).t()), "unit stride"),
])
def test_kernel_checks_its_arguments(bad, message):
    args = dict(logits=torch.zeros(4, 100), bitmask=torch.zeros(2, 4, dtype=torch.int32), rows=torch.tensor([0, 1]))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        kernel(**args)
