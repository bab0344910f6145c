"""The gathered LoRA kernels (kernels/triton_lora.py) against their torch twin: rows of several
slots and base rows (-1) in any order, poisoned outputs, every rank shape the banks take."""

import pytest
import torch

from pie.kernels.triton_lora import K_CHUNK, lora_delta_, lora_delta_reference_, slot_onehot, slot_order, wide_b_bank


def _banks(slots: int, rank_rows: int, k: int, n: int, dtype, device, gen):
    a = torch.randn(slots, rank_rows, k, generator=gen).to(dtype).to(device)
    b = (torch.randn(slots, n, rank_rows, generator=gen) * 0.5).to(dtype).to(device)
    return a, b


@pytest.mark.parametrize(("rows", "k", "n", "rank_rows"), [(1, 32, 48, 8), (37, 64, 80, 24), (70, 40, 33, 64)])
def test_matches_twin_on_mixed_rows(rng, rows, k, n, rank_rows):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    a, b = _banks(4, rank_rows, k, n, torch.float32, "cpu", gen)
    x = torch.randn(rows, k, generator=gen)
    slots = torch.randint(-1, 4, (rows,), generator=gen, dtype=torch.int32)
    base = torch.randn(rows, n, generator=gen)
    want = lora_delta_reference_(base.clone(), x, a, b, slots)
    got = lora_delta_(base.clone(), x, a, b, slots)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # base rows (-1) untouched, to the bit
    keep = slots < 0
    assert torch.equal(got[keep], base[keep])
    assert not torch.equal(got[~keep], base[~keep]) or not bool((~keep).any())


def test_prompt_segments_and_decode_rows(rng):
    """A step's layout: decode rows of mixed slots first, then prompt chunks (one slot each)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    a, b = _banks(3, 16, 48, 64, torch.float32, "cpu", gen)
    slots = torch.tensor([2, -1, 0, 2, 1] + [1] * 21 + [-1] * 9 + [0] * 18, dtype=torch.int32)
    x = torch.randn(slots.numel(), 48, generator=gen)
    base = torch.randn(slots.numel(), 64, generator=gen)
    want = lora_delta_reference_(base.clone(), x, a, b, slots)
    got = lora_delta_(base.clone(), x, a, b, slots, slot_order(slots))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_one_row_per_slot_is_its_own_product(rng):
    """Each row's delta equals the plain product with its slot's weights: no row reads another
    row's slot, however the rows are ordered."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    a, b = _banks(5, 8, 32, 32, torch.float32, "cpu", gen)
    slots = torch.tensor([4, 0, 3, 1, 2, 0, 4], dtype=torch.int32)
    x = torch.randn(7, 32, generator=gen)
    got = lora_delta_(torch.zeros(7, 32), x, a, b, slots)
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(got[i], (x[i] @ a[s].T) @ b[s].T, rtol=1e-4, atol=1e-4)


def test_input_cut_in_chunks(rng):
    """K past K_CHUNK (the shrink's programs over input columns; the last chunk partial): the same
    deltas as the twin, and a row's delta the same alone as among other rows and slots (to the bit
    on the GPU, test_gpu_matches_twin; the interpreter's numpy dots round a row by its place in
    the block)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k = 2 * K_CHUNK + 76
    a, b = _banks(3, 16, k, 40, torch.float32, "cpu", gen)
    a /= k ** 0.5
    slots = torch.tensor([1, -1, 0, 2, 1, 0, 0, 2, 1, -1, 2, 0, 1, 1, 0, 2, 2, 1, 0], dtype=torch.int32)
    x = torch.randn(slots.numel(), k, generator=gen)
    base = torch.randn(slots.numel(), 40, generator=gen)
    got = lora_delta_(base.clone(), x, a, b, slots)
    torch.testing.assert_close(got, lora_delta_reference_(base.clone(), x, a, b, slots), rtol=1e-4, atol=1e-4)
    for i in (0, 3, 17):
        alone = lora_delta_(base[i:i + 1].clone(), x[i:i + 1], a, b, slots[i:i + 1])
        torch.testing.assert_close(alone[0], got[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("shrink", "block_t", "wide"), [("gemm", 16, False), ("chunks", 32, False), ("gemm", 64, False),
                                                        ("chunks", 16, True), ("gemm", 16, True), ("masked", 16, True)])
def test_other_shrinks_and_row_blocks(rng, shrink, block_t, wide):
    """t from one product over every slot (each row reading its own slot's columns; or, masked,
    every slot's columns but its own zeroed and one product with every slot's B), blocks of more
    rows than tl.dot's least, and B banks stored wide ((N, S, R), read by their strides): the
    twin's deltas for decode rows of mixed slots, base rows and prompt segments, with K past
    K_CHUNK; base rows untouched to the bit."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k = K_CHUNK + 40
    a, b = _banks(4, 24, k, 56, torch.float32, "cpu", gen)
    a /= k ** 0.5
    if wide:
        b = wide_b_bank(4, 56, 24, dtype=torch.float32, device="cpu").copy_(b)
    slots = torch.tensor([3, -1, 0, 2, 1, 3, -1] + [1] * 27 + [-1] * 5 + [2] * 30, dtype=torch.int32)
    x = torch.randn(slots.numel(), k, generator=gen)
    base = torch.randn(slots.numel(), 56, generator=gen)
    want = lora_delta_reference_(base.clone(), x, a, b, slots)
    got = lora_delta_(base.clone(), x, a, b, slots, slot_order(slots), shrink=shrink, block_t=block_t)
    if shrink == "masked":  # the step's one-hot given, as the model passes it: the same
        given = lora_delta_(base.clone(), x, a, b, slots, shrink=shrink, onehot=slot_onehot(slots, 4, x.dtype))
        assert torch.equal(given, got)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    keep = slots < 0
    assert torch.equal(got[keep], base[keep])


def test_no_adapter_rows_and_empty_batch():
    a = torch.ones(2, 8, 16)
    b = torch.ones(2, 16, 8)
    y = torch.full((3, 16), 7.0)
    lora_delta_(y, torch.ones(3, 16), a, b, torch.full((3,), -1, dtype=torch.int32))
    assert bool((y == 7.0).all())
    empty = torch.empty(0, 16)
    assert lora_delta_(empty, torch.empty(0, 16), a, b, torch.empty(0, dtype=torch.int32)).shape == (0, 16)


def test_refuses_mismatched_shapes():
    a = torch.ones(2, 8, 16)
    b = torch.ones(2, 16, 8)
    with pytest.raises(AssertionError, match="input width"):
        lora_delta_(torch.zeros(3, 16), torch.ones(3, 12), a, b, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(AssertionError, match="int32"):
        lora_delta_(torch.zeros(3, 16), torch.ones(3, 16), a, b, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(AssertionError, match="shrink must be one of"):
        lora_delta_(torch.zeros(3, 16), torch.ones(3, 16), a, b, torch.zeros(3, dtype=torch.int32), shrink="mm")
    with pytest.raises(AssertionError, match="needs B stored as"):
        lora_delta_(torch.zeros(3, 16), torch.ones(3, 16), a, b, torch.zeros(3, dtype=torch.int32), shrink="masked")
    with pytest.raises(AssertionError, match="block_t 24"):
        lora_delta_(torch.zeros(3, 16), torch.ones(3, 16), a, b, torch.zeros(3, dtype=torch.int32), block_t=24)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shrink", "block_t"), [("chunks", 16), ("gemm", 64), ("masked", 16)])
def test_gpu_matches_twin(rng, dtype, shrink, block_t):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    a, b = _banks(9, 48, 3584, 4608, dtype, "cuda", gen)
    if shrink == "masked":
        b = wide_b_bank(9, 4608, 48, dtype=dtype, device="cuda").copy_(b)
    rows = 300
    slots = torch.randint(-1, 9, (rows,), generator=gen, dtype=torch.int32).cuda()
    x = torch.randn(rows, 3584, generator=gen).to(dtype).cuda() * 0.1
    base = torch.randn(rows, 4608, generator=gen).to(dtype).cuda()
    want = lora_delta_reference_(base.clone(), x, a, b, slots)
    got = base.clone()
    got[slots >= 0] = float("nan")  # poisoned: every adapter row must be written...
    got = torch.where(slots[:, None] >= 0, base, got)  # ...from the base it had (restored here)
    lora_delta_(got, x, a, b, slots, shrink=shrink, block_t=block_t)
    assert bool(torch.isfinite(got).all())
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 2e-2, err
    if shrink == "chunks":
        # K = 3,584 in 7 chunks summed in a fixed order: a row's delta is the same bits in any batch
        for i in (0, 1, 150, 299):
            alone = lora_delta_(base[i:i + 1].clone(), x[i:i + 1], a, b, slots[i:i + 1])
            assert torch.equal(alone[0], got[i]), i
