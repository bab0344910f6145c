"""The draft model of speculative decoding (`pie serve --speculative draft --draft-model DIR`).

A small model with the target's tokenizer proposes K tokens per request and step; the target
verifies them in one forward pass (engine/spec_decode/speculator.py). The draft keeps its K/V in a pool of
its own with as many blocks as the target's, addressed by the same block ids: a request's draft
K/V live in the blocks the target gave it, so the draft needs no block manager, preemption frees
both at once, and rolling back rejected proposals is one number (`Request.draft_computed`, the
positions the draft's cache holds for this request, lowered to the accepted ones after each
verify step). A request starts with nothing in the draft's cache (prefix-cache hits included: a
cached block's draft half may hold another request's draft K/V, equal or stale, never read before
this request's draft wrote it).

Per step (`DraftProposer.propose`, after the scheduler reserved k <= K proposals per request):
the draft first runs each speculating request's tokens it has not seen, up to and including the
newest (in chunks of its token budget), then proposes autoregressively: proposal i from the
draft's logits processed as the target processes them for the output it guesses (logit bias,
min_tokens, penalties over the outputs and proposals before it, temperature and filters), argmax
for greedy requests, else a draw from the draft's own random stream. The distributions q go to
verification, which accepts a draw d with probability min(1, p(d) / q(d)) (exact in distribution
whatever q is: a poor draft costs speed, never correctness). Structured-output masks are not
applied to the draft: a proposal the grammar refuses has p = 0 and is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from pie.model.llama import LlamaForCausalLM
from pie.model.tokenizer import Tokenizer

from ..config import EngineConfig
from ..device import to_device
from ..errors import StartupError
from ..runner.kv_cache import KVCache
from ..runner.model_runner import ModelRunner
from ..sample.rejection import DraftProbs, draft_distribution, draft_draw
from ..sample.tensors import SamplingTensors
from ..scheduling.request import Request
from ..scheduling.step import ScheduledRequest, SchedulerOutput

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class DraftModel:
    """The draft's weights and what its cache is sized from."""

    model: LlamaForCausalLM
    path: str

    def block_bytes(self, config: EngineConfig) -> int:
        """Bytes of one block of the draft's pool (all its layers, K and V, scales included)."""
        mc = self.model.config
        return KVCache.bytes_per_block(num_layers=mc.num_hidden_layers, block_size=config.block_size,
                                       num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
                                       kv_cache_dtype=config.kv_cache_dtype)


def load_draft(config: EngineConfig, device: torch.device, dtype: torch.dtype, tokenizer: Tokenizer,
               max_model_len: int) -> DraftModel:
    """Loads `config.draft_model`; StartupError when it cannot serve as the target's draft (another
    tokenizer, a shorter context)."""
    from pie.model.loader import load_model

    from ..model_check import read_tokenizer

    path = config.draft_model
    assert path is not None
    try:
        model, mc = load_model(path, device=device, dtype=dtype)
    except (OSError, ValueError) as e:
        raise StartupError(f"--draft-model {path}: cannot load it ({e})") from e
    model.eval()
    if device.type == "cuda":
        from pie.kernels import triton_fused

        model.use_fused_ops(triton_fused)
    theirs = read_tokenizer(path, mc)
    if theirs.backend.get_vocab(with_added_tokens=True) != tokenizer.backend.get_vocab(with_added_tokens=True):
        raise StartupError(f"--draft-model {path}: its tokenizer is not the model's (the ids of its vocabulary "
                           "differ): a draft must share the model's tokenizer")
    if mc.max_model_len < max_model_len:
        raise StartupError(f"--draft-model {path}: its context ({mc.max_model_len} tokens) is shorter than the "
                           f"model's ({max_model_len}): lower --max-model-len to {mc.max_model_len}")
    log.info("draft_model_loaded", path=path, architecture=mc.architecture, layers=mc.num_hidden_layers,
             hidden_size=mc.hidden_size)
    return DraftModel(model, path)


class DraftProposer:
    """Proposals from a draft model (module docstring)."""

    method = "draft"

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner  # the draft's, over its own pool (same block ids as the target's)
        runner.reads_proposals = True  # its rows run into the proposals it made
        self.vocab_size = vocab_size  # the target's: q is over the target's vocabulary
        self.device = runner.device

    def reserve(self, request: Request, k: int) -> int:
        request.spec_token_ids = []  # made in propose, once the step's blocks are allocated
        return k

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> DraftProbs | None:
        rows = [s for s in out.scheduled if s.num_spec]
        if not rows:
            return None
        reqs = [s.request for s in rows]
        ks = [s.num_spec for s in rows]
        for r in reqs:
            assert not r.num_output_placeholders, f"{r}: a draft row with an id not read back"
            r.spec_token_ids = []
        logits = self._catch_up(reqs)
        steps_q: list[torch.Tensor] = []  # [i]: q of proposal i + 1 of the requests with k > i
        active = list(range(len(reqs)))
        for i in range(max(ks)):
            active = [j for j in active if ks[j] > i]
            if i:
                logits = self._forward_one([reqs[j] for j in active], i)
            t = self._tensors([reqs[j] for j in active], i)
            q = draft_distribution(logits, t)
            drawn = draft_draw(q, t).tolist()
            for j, d in zip(active, drawn):
                reqs[j].spec_token_ids.append(d)
            steps_q.append(q)
        for r, k in zip(reqs, ks):
            r.draft_computed = r.num_tokens + k - 1  # the last proposal itself was not run
        # Verification reads q request by request, each request's proposals in order.
        offsets = [0]
        for q in steps_q:
            offsets.append(offsets[-1] + q.shape[0])
        order: list[int] = []
        for j, k in enumerate(ks):
            order += [offsets[i] + sum(1 for jj in range(j) if ks[jj] > i) for i in range(k)]
        q_all = torch.cat(steps_q) if len(steps_q) > 1 else steps_q[0]
        return DraftProbs(q_all.index_select(0, to_device(torch.tensor(order, dtype=torch.int64), q_all.device)))

    def _catch_up(self, reqs: list[Request]) -> torch.Tensor:
        """Runs each request's tokens the draft has not seen, the newest included, in steps of the
        runner's token budget; returns the draft's logits after each request's newest token (B, V)."""
        budget_max = self.runner.max_tokens
        done = [r.draft_computed for r in reqs]
        last: list[torch.Tensor | None] = [None] * len(reqs)
        while any(d < r.num_tokens for d, r in zip(done, reqs)):
            scheduled, which, budget = [], [], budget_max
            for j, r in enumerate(reqs):
                n = min(r.num_tokens - done[j], budget)
                if n <= 0:
                    continue
                scheduled.append(ScheduledRequest(r, n, done[j], done[j] + n == r.num_tokens))
                which.append(j)
                budget -= n
                if budget == 0:
                    break
            sampling, logits = self.runner.forward_logits(
                SchedulerOutput(scheduled=scheduled, num_batched_tokens=budget_max - budget))
            for row, i in enumerate(sampling):
                assert logits is not None
                last[which[i]] = self._to_vocab(logits[row:row + 1]).clone()  # a graph's buffer is rewritten
            for s, j in zip(scheduled, which):
                done[j] += s.num_new_tokens
        assert all(x is not None for x in last)
        return torch.cat(last)  # type: ignore[arg-type]

    def _forward_one(self, reqs: list[Request], i: int) -> torch.Tensor:
        """The draft's logits after each request's proposal i (its input at position
        num_tokens + i - 1): one decode step of the draft."""
        scheduled = [ScheduledRequest(r, 1, r.num_tokens + i - 1, True) for r in reqs]
        rows, logits = self.runner.forward_logits(SchedulerOutput(scheduled=scheduled, num_batched_tokens=len(reqs)))
        assert logits is not None and len(rows) == len(reqs)
        return self._to_vocab(logits[:len(reqs)])

    def _to_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary: ids the draft lacks get -inf (q = 0),
        ids past the target's are dropped (padding rows of the draft's embedding)."""
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits.float()
        if v > self.vocab_size:
            return logits[:, :self.vocab_size].float()
        pad = torch.full((logits.shape[0], self.vocab_size - v), float("-inf"), device=logits.device)
        return torch.cat([logits.float(), pad], dim=1)

    def _tensors(self, reqs: list[Request], i: int) -> SamplingTensors:
        """Sampling tensors of proposal i + 1 of each request: the output it guesses is number
        len(output) + i, after proposals 1..i (penalties count them, as verification does)."""
        return SamplingTensors.build(
            params=[r.sampling for r in reqs], seeds=[r.seed for r in reqs],
            steps=[len(r.output_token_ids) + i for r in reqs], prompt_ids=[r.prompt_token_ids for r in reqs],
            output_ids=[r.output_token_ids + r.spec_token_ids[:i] if i else r.output_token_ids for r in reqs],
            vocab_size=self.vocab_size, device=self.device, eos_token_ids=[r.eos_token_ids for r in reqs])
