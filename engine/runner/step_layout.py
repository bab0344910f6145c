"""The layouts of a step's inputs on the device: what `StepStager` (engine/runner/staging.py) writes
and the forward pass, the attention kernels, the captured CUDA graphs and tensor-parallel workers
read.

Packed int32 layout, for T tokens and B sequences (decode: T = B):

    | input ids (T) | positions (T) | slots (T) | seq lens (B) | query start loc (B + 1) |
    | query start loc of a mixed step's prefill part (B - nd + 1, rebased to 0; mixed steps only) |
    | key start loc of the prefill part: cumulative seq lens of rows nd.. (B - nd + 1; any prompt) |
    | (token index, row of the last sample) of up to B placeholder inputs (async scheduling)     |

A mixed step's first nd sequences are running decodes (the scheduler orders them first): they
attend through the decode kernel, the rest through the extend kernel. A row of one token counts as
a decode, a prompt's last token too (its chunk's remainder, or the token after a cached prefix),
except in the batch-invariant mode (`prompt_rows_decode` off): there a prompt token is always
attended by the extend kernel, as it is when its whole prompt runs in one step, since the two
kernels round the same query differently. The key starts of those
rest are where each one's keys begin once gathered from the pages (kernels/flash_prefill.py):
summed here on the host, once per step, instead of on the device in every layer.

For a decode step replayed from a CUDA graph (engine/runner/cuda_graphs.py) the sections are laid out
for its bucket's size: rows past the batch are padding, with slot -1 (the cache write skips them)
and length 0 (attention reads nothing).

A verify step replayed from a CUDA graph (`StepStager.stage_verify`) is strided instead of packed: each of the
bucket's B rows is W = 1 + K tokens wide, row i at [i W, (i + 1) W), T = B W:

    ids, positions, slots:  | row 0: newest, proposals 1..k0, pad | row 1: ... | padding rows |
    seq lens (B):           start_i + W (padding rows: W), so the W queries end where the row's
                            real ones would and `start_i` tokens are cached before them
    query start loc (B+1):  0, W, 2W, ..., BW
    then the logits rows the step keeps: i W + j for j = 0..k_i, row by row

Padding tokens have id 0, position 0 and slot -1; they come after the row's real tokens, so no real
query sees them, and their logits are never taken. The block tables are staged wide enough for
every key position below start_i + W, zero (block 0, read but not written) past a row's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduling.request import Request
from .attention import AttentionMetadata


@dataclass(slots=True)
class LastSample:
    """The previous step's sampled ids, left on the device: the inputs of tokens sampled and not
    read back yet (async scheduling's placeholders)."""

    ids: torch.Tensor  # (R,) int64 on the device
    requests: list[Request]  # the requests of its rows, in row order
    rows: dict[str, int]  # request id -> row of `ids` (rebuilt with every sample that is not steady)


@dataclass(slots=True, frozen=True)
class Packed:
    """Offsets of the packed int32 sections (module docstring) for n_tok tokens and rows sequences;
    the one place that layout is written down, for `StepStager.stage` and `capture_cuda_graphs`."""

    n_tok: int
    rows: int

    @property
    def ids(self) -> slice:
        return slice(0, self.n_tok)

    @property
    def positions(self) -> slice:
        return slice(self.n_tok, 2 * self.n_tok)

    @property
    def slots(self) -> slice:
        return slice(2 * self.n_tok, 3 * self.n_tok)

    @property
    def seq_lens(self) -> slice:
        return slice(3 * self.n_tok, 3 * self.n_tok + self.rows)

    @property
    def query_start_loc(self) -> slice:
        return slice(3 * self.n_tok + self.rows, self.end)

    @property
    def end(self) -> int:
        """Where the optional sections (a mixed step's prefill query starts, pending ids) begin."""
        return 3 * self.n_tok + 2 * self.rows + 1

    def metadata(self, dev: torch.Tensor, block_tables: torch.Tensor, **facts) -> AttentionMetadata:
        """AttentionMetadata viewing `dev` (the packed ints on the device) in this layout."""
        return AttentionMetadata(slot_mapping=dev[self.slots], block_tables=block_tables,
                                 seq_lens=dev[self.seq_lens], query_start_loc=dev[self.query_start_loc], **facts)


@dataclass(slots=True)
class StepFacts:
    """The numbers that, with the packed ints and the block tables, make a step's inputs: what
    tensor-parallel workers receive to run the same forward pass (engine/runner/tensor_parallel.py)."""

    n_tok: int  # the layout's token count (T, or the graph bucket)
    rows: int  # the layout's sequence rows
    n_ints: int  # packed ints in use: the layout's sections plus the prefill part's query and key starts
    n_prefill_ints: int
    n_key_ints: int  # the prefill part's key starts (0: none staged)
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    decode_max_seq_len: int
    prefill_kv_tokens: int  # keys in the cache of the rows from num_decodes on (0 for verify steps)

    def numbers(self) -> tuple[int, ...]:
        return (self.n_tok, self.rows, self.n_ints, self.n_prefill_ints, self.n_key_ints, self.max_query_len,
                self.max_seq_len, self.num_decodes, self.decode_max_seq_len, self.prefill_kv_tokens)

    def metadata(self, ints: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
        layout = Packed(n_tok=self.n_tok, rows=self.rows)
        qsl_end = layout.end + self.n_prefill_ints
        return layout.metadata(ints, block_tables, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                               num_decodes=self.num_decodes, decode_max_seq_len=self.decode_max_seq_len,
                               prefill_kv_tokens=self.prefill_kv_tokens,
                               prefill_query_start_loc=ints[layout.end:qsl_end] if self.n_prefill_ints else None,
                               prefill_key_start_loc=ints[qsl_end:qsl_end + self.n_key_ints] if self.n_key_ints else None)


@dataclass(slots=True)
class StepInputs:
    """One step's inputs on the device (views of the runner's buffers) and its host facts."""

    input_ids: torch.Tensor  # (T,) int32
    positions: torch.Tensor  # (T,) int32
    metadata: AttentionMetadata
    num_seqs: int
    graph_batch: int | None  # bucket whose graph runs this step; None = eager
    facts: StepFacts
    ints: torch.Tensor  # the packed ints on the device (n_ints)
    # A verify step in the strided layout (`stage_verify`): the rows of its graph's logits the
    # step keeps, (sum of 1 + k_i,) int32 on the device, in the eager step's order; else None.
    logits_index: torch.Tensor | None = None
