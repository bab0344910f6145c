"""Gathered LoRA deltas for a batch whose rows use different adapters (Punica's BGMV/SGMV idea).

    x       (T, K)      the projection's input rows             bf16 | fp16 | fp32
    a_bank  (S, R, K)   slot s's A, rank rows padded with zeros  x.dtype
    b_bank  (S, N, R)   slot s's B, its scaling folded in        x.dtype
    slots   (T,)        int32: the slot of each row; -1 = no adapter (the row is left as it is)
    y       (T, N)      the base projection's output: y[t] += (x[t] . A[s]^T) . B[s]^T, in place

One pair of kernels serves decode rows and prompt segments alike. The rows are visited in slot
order (`order`, a stable argsort of `slots`, made on the device: nothing here syncs with the host,
so a CUDA graph can hold it with `slots` as its input), BLOCK_T of them per program. A program's
rows come in few distinct slots (a prompt chunk is one; a block of decode rows sorted by slot, one
or two), and it runs one `tl.dot` per distinct slot over the rows that use it, loading that slot's
weights once for all of them:

    shrink  grid (cdiv(T, BLOCK_T), C):             part[c, rows] = x[rows, chunk c] . A[s, :, chunk c]^T
    reduce  (C > 1)                                  t = part[0] + part[1] + ... + part[C-1]   (T, R) fp32
    expand  grid (cdiv(T, BLOCK_T), cdiv(N, BLOCK_N)): y[rows, n] += t[rows] . B[s][n]^T

The shrink cuts K into C = cdiv(K, K_CHUNK) chunks of a fixed width, a program each: a 256-row
decode step has only 16 blocks of rows, and with the whole K in one program each (28 tiles in
sequence at K = 3,584, 148 for a down projection's 18,944) 16 programs would run on a chip of 132
SMs. The chunks' partial sums add up in chunk order whatever T is, so a row's t is the same bits in
any batch. The intermediate t is rounded to x's dtype before the expand, as a LoRA layer computing
`lora_B(lora_A(x))` in the model's dtype does. Rows with slot -1 are never written.

`shrink="gemm"` is the other way to make t: one dense product of x with every slot's A at once,

    shrink  t_all = x . [A[0]; A[1]; ...; A[S-1]]^T      (T, S R) in x's dtype (the library GEMM)
    expand  as above, each row reading its own slot's R columns of t_all

S times the shrink's multiply-adds, which are few beside the base projection's when S R is a
small fraction of N, in one library call instead of two launches of small programs. The library
picks its own reduction by T, so t is not batch-invariant this way: the chunked shrink stays for
the batch-invariant mode.

`shrink="masked"` leaves the Triton kernels out altogether: t_all as above, each row's columns of
the other slots zeroed by the step's one-hot of its slot, then one library GEMM with beta 1,

    t_all *= onehot (T, S) per slot's R columns     (a row of slot -1: all zero, y + 0 exactly)
    y     += t_all . B_all^T                         B_all (N, S R): every slot's B side by side

which needs B stored as (N, S, R) in memory (`wide_b_bank`; b_bank is then a (S, N, R) view of it,
which the expand kernel reads by its strides). S times the delta's multiply-adds on both sides,
three library launches a projection and no small programs; not batch-invariant either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_tile import cdiv, next_pow2

BLOCK_T = 16  # rows per program: tl.dot's least M on the GPU
MAX_RANK = 512  # R, padded: every rank row of a slot sits in one tile
K_CHUNK = 512  # input columns per shrink program (a multiple of every BLOCK_K); fixed: batch-invariant sums


@triton.jit
def _block_rows(slots_ptr, order_ptr, num_rows, BLOCK_T: tl.constexpr):
    """This program's rows in slot order (int64 row indices) and their slots (-1 past the batch)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_batch = offs_t < num_rows
    rows = tl.load(order_ptr + offs_t, mask=in_batch, other=0).to(tl.int64)
    return rows, tl.load(slots_ptr + rows, mask=in_batch, other=-1)


@triton.jit
def _next_slot(slot, prev):
    """The smallest slot id above `prev` among the block's rows (2**30: none left)."""
    return tl.min(tl.where(slot > prev, slot, 1 << 30), axis=0)


# One compile for every batch: T, the row strides and the slot tensor's offset change every step.
@triton.jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["slots_ptr", "order_ptr"])
def _shrink_kernel(x_ptr, a_ptr, part_ptr, slots_ptr, order_ptr, num_rows, stride_x,
                   K: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """The partial t of this program's rows over input columns [c K_CHUNK, (c + 1) K_CHUNK), c =
    program_id(1), into part[c] (T, R) fp32."""
    rows, slot = _block_rows(slots_ptr, order_ptr, num_rows, BLOCK_T)
    chunk = tl.program_id(1)
    t_ptr = part_ptr + chunk.to(tl.int64) * num_rows * R
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    cur = _next_slot(slot, -1)
    while cur < (1 << 30):
        use = slot == cur
        acc = tl.zeros((BLOCK_T, R_PAD), tl.float32)
        a_base = a_ptr + cur.to(tl.int64) * (R * K)
        for k0 in range(chunk * K_CHUNK, tl.minimum((chunk + 1) * K_CHUNK, K), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xs = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=use[:, None] & k_ok[None, :],
                         other=0.0)  # (BLOCK_T, BLOCK_K)
            a = tl.load(a_base + offs_r[None, :] * K + offs_k[:, None], mask=r_ok[None, :] & k_ok[:, None],
                        other=0.0)  # (BLOCK_K, R_PAD): A^T
            acc = tl.dot(xs.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision=PRECISION)
        tl.store(t_ptr + rows[:, None] * R + offs_r[None, :], acc, mask=use[:, None] & r_ok[None, :])
        cur = _next_slot(slot, cur)


@triton.jit(do_not_specialize=["size"])
def _reduce_kernel(part_ptr, t_ptr, size, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """t = part[0] + ... + part[CHUNKS - 1], in that order (part: (CHUNKS, size) fp32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for c in tl.static_range(1, CHUNKS):
        acc += tl.load(part_ptr + c * size + offs, mask=ok, other=0.0)
    tl.store(t_ptr + offs, acc, mask=ok)


@triton.jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["slots_ptr", "order_ptr"])
def _expand_kernel(t_ptr, b_ptr, y_ptr, slots_ptr, order_ptr, num_rows, stride_y, stride_t, slot_cols,
                   stride_bs, stride_bn, N: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """y[rows, n tile] += t . B^T for this program's rows; a row's t at t[row, slot * slot_cols:]
    (slot_cols 0: t holds the row's own R columns only; R: t_all of every slot, shrink="gemm");
    B[s, n, r] at b_ptr + s stride_bs + n stride_bn + r."""
    rows, slot = _block_rows(slots_ptr, order_ptr, num_rows, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    cur = _next_slot(slot, -1)
    while cur < (1 << 30):
        use = slot == cur
        # t rounded to the activations' dtype first (y's element type), as lora_B(lora_A(x)) is
        t = tl.load(t_ptr + rows[:, None] * stride_t + cur * slot_cols + offs_r[None, :],
                    mask=use[:, None] & r_ok[None, :], other=0.0)
        t = t.to(y_ptr.dtype.element_ty).to(DOT_DTYPE)
        b = tl.load(b_ptr + cur.to(tl.int64) * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn + offs_r[:, None],
                    mask=n_ok[None, :] & r_ok[:, None], other=0.0)  # (R_PAD, BLOCK_N): B^T
        delta = tl.dot(t, b.to(DOT_DTYPE), input_precision=PRECISION)  # (BLOCK_T, BLOCK_N) fp32
        ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        mask = use[:, None] & n_ok[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)
        cur = _next_slot(slot, cur)


def _dot_types(dtype: torch.dtype, on_gpu: bool):
    # fp32 in the CPU interpreter (its bf16 arithmetic is wrong) and for fp32 inputs, exact there
    if on_gpu and dtype in (torch.bfloat16, torch.float16):
        return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), None
    return tl.float32, "ieee"


def slot_order(slots: torch.Tensor) -> torch.Tensor:
    """The rows in slot order (T,) int32: the visiting order of `lora_delta_`, made once per step
    and shared by every projection. On the device, without a host sync."""
    return torch.argsort(slots, stable=True).to(torch.int32)


SHRINKS = ("chunks", "gemm", "masked")  # how t is made (module docstring)


def wide_b_bank(num_slots: int, n: int, rank_rows: int, *, dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """A zeroed B bank (S, N, R) whose memory is (N, S, R): every slot's B side by side in one
    (N, S R) matrix, as shrink="masked" needs (the other shrinks read it by its strides)."""
    return torch.zeros(n, num_slots, rank_rows, dtype=dtype, device=device).permute(1, 0, 2)


def slot_onehot(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, S) in `dtype`: 1 where a row uses the slot (a row of slot -1: all zeros). On the device,
    without a host sync; made once per step and shared by every projection (shrink="masked")."""
    return (slots[:, None] == torch.arange(num_slots, device=slots.device, dtype=slots.dtype)).to(dtype)


def lora_delta_(y: torch.Tensor, x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                slots: torch.Tensor, order: torch.Tensor | None = None, *, shrink: str = "chunks",
                block_t: int = BLOCK_T, onehot: torch.Tensor | None = None) -> torch.Tensor:
    """y += the LoRA delta of each row's slot (module docstring); the Triton twin of
    `lora_delta_reference_`. order: `slot_order(slots)` when the caller has it. shrink: one of
    SHRINKS. block_t: rows per program (a power of two, at least 16). onehot: `slot_onehot(slots,
    S, x.dtype)` when the caller has it (shrink="masked" only). Returns y."""
    t_rows, k = x.shape
    s, r, k_a = a_bank.shape
    assert k_a == k, f"A's input width {k_a} vs x's {k}"
    assert b_bank.shape[0] == s and b_bank.shape[2] == r, f"B {tuple(b_bank.shape)} vs A {tuple(a_bank.shape)}"
    n = b_bank.shape[1]
    assert y.shape == (t_rows, n), f"y must be ({t_rows}, {n}), got {tuple(y.shape)}"
    assert slots.shape == (t_rows,) and slots.dtype == torch.int32, "slots must be (T,) int32"
    assert x.stride(1) == 1 and y.stride(1) == 1, "rows must be contiguous"
    assert a_bank.is_contiguous() and b_bank.stride(2) == 1, "A contiguous, B's rank columns contiguous"
    assert a_bank.dtype == b_bank.dtype == x.dtype == y.dtype, "x, y and the banks share one dtype"
    assert 1 <= r <= MAX_RANK, f"rank rows {r} outside 1..{MAX_RANK}"
    assert shrink in SHRINKS, f"shrink must be one of {SHRINKS}, got {shrink!r}"
    assert block_t >= 16 and block_t & (block_t - 1) == 0, f"block_t {block_t}: a power of two >= 16"
    if t_rows == 0:
        return y
    if shrink == "masked":
        b_all = b_bank.permute(1, 0, 2)  # (N, S, R)
        assert b_all.is_contiguous(), "shrink='masked' needs B stored as (N, S, R) (wide_b_bank)"
        if onehot is None:
            onehot = slot_onehot(slots, s, x.dtype)
        assert onehot.shape == (t_rows, s) and onehot.dtype == x.dtype, "onehot must be (T, S) in x's dtype"
        t = torch.mm(x, a_bank.view(s * r, k).T).view(t_rows, s, r)
        t.mul_(onehot[:, :, None])
        return y.addmm_(t.view(t_rows, s * r), b_all.view(n, s * r).T)
    if order is None:
        order = slot_order(slots)
    on_gpu = x.is_cuda
    dot_dtype, precision = _dot_types(x.dtype, on_gpu)
    r_pad = max(16, next_pow2(r))
    blocks = cdiv(t_rows, block_t)
    if shrink == "gemm":  # every slot's t at once, rounded to x's dtype by the product itself
        t = torch.mm(x, a_bank.view(s * r, k).T)  # (T, S R)
        slot_cols = r
    else:
        chunks = cdiv(k, K_CHUNK)
        part = torch.empty((chunks, t_rows, r), dtype=torch.float32, device=x.device)
        block_k = max(16, min(128, next_pow2(k))) if on_gpu else 32  # (each divides K_CHUNK)
        _shrink_kernel[(blocks, chunks)](x, a_bank, part, slots, order, t_rows, x.stride(0), K=k, R=r,
                                         R_PAD=r_pad, BLOCK_T=block_t, BLOCK_K=block_k, K_CHUNK=K_CHUNK,
                                         DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=4)
        if chunks == 1:
            t = part[0]
        else:
            t = torch.empty((t_rows, r), dtype=torch.float32, device=x.device)
            _reduce_kernel[(cdiv(t_rows * r, 1024),)](part, t, t_rows * r, CHUNKS=chunks, BLOCK=1024, num_warps=4)
        slot_cols = 0
    block_n = max(16, min(128 if on_gpu else 32, next_pow2(n)))
    _expand_kernel[(blocks, cdiv(n, block_n))](t, b_bank, y, slots, order, t_rows, y.stride(0), t.stride(0),
                                               slot_cols, b_bank.stride(0), b_bank.stride(1), N=n, R=r, R_PAD=r_pad, BLOCK_T=block_t,
                                               BLOCK_N=block_n, DOT_DTYPE=dot_dtype, PRECISION=precision,
                                               num_warps=4)
    return y


def lora_delta_reference_(y: torch.Tensor, x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                          slots: torch.Tensor, order: torch.Tensor | None = None, *,
                          onehot: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin of `lora_delta_` (and the CPU path): per distinct slot, its rows' delta in
    fp32, the intermediate rounded to x's dtype. Syncs with the host (the slots present)."""
    del order, onehot  # the visiting order and the one-hot change nothing here
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        t = (x[rows].float() @ a_bank[s].float().T).to(x.dtype).float()
        y[rows] = (y[rows].float() + t @ b_bank[s].float().T).to(y.dtype)
    return y
