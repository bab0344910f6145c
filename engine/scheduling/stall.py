"""The stall bound: how many prompt tokens a step may carry beside its running decodes, so that
a long prompt chunk does not stall every decode it runs with (DESIGN: latency under load). The
scheduler asks it for each step's prompt budget; the engine core reports every step's shape and
measured time to it. The stall budget: which steps may go past the bound anyway, to work off a
backlog of prompts at the price of a small share of the streams' gaps."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from .request import Request
from .step import SchedulerOutput


class StallBound:
    """How many prompt tokens a step may carry beside its running decodes, learnt from step times.

    A step is modelled as t_decode + t_fixed + c_prompt x prompt tokens. t_decode is the step's
    decodes alone: on CUDA the decode graph of the batch's bucket (`prior`, timed at start with
    one-token contexts) plus `kv_token_s` per token of the decodes' contexts, times the measured
    ratio of decode-only steps to that model; without a prior (the CPU, eager mode, tensor
    parallelism), the average of recent decode-only steps. t_fixed (what carrying any prompt costs)
    and c_prompt are a line fitted by least squares to the last WINDOW prompt-carrying steps, its
    slope only while their sizes spread (coefficient of variation >= SPREAD), else only the
    intercept follows. A step with decodes gets ((factor - 1) x t_decode - t_fixed) / c_prompt prompt
    tokens, never fewer than t_fixed / c_prompt (a step that pays the fixed part carries at least as
    much again) nor `min_tokens`; no bound before c_prompt is measured. A step counts at most SPIKE
    times what the model expects of it, so one stalled by something else (a compile, a collection)
    moves the bound by little."""

    SPIKE = 2.0
    WINDOW = 32  # prompt-carrying steps the line is fitted to
    SPREAD = 0.25  # their sizes' coefficient of variation from which the slope is fitted too

    def __init__(self, factor: float, min_tokens: int, alpha: float = 0.2) -> None:
        if factor and factor <= 1.0:
            raise ValueError(f"stall factor must be 0 (off) or > 1, got {factor}")
        self.factor = factor
        self.min_tokens = min_tokens
        self.alpha = alpha
        self.decode_s: float | None = None  # a decode-only step, seconds (without a prior)
        self.decode_ratio = 1.0  # measured decode-only steps over the prior's model of them
        self._ratio_measured = False
        self.per_prompt_token_s: float | None = None  # c_prompt: a prompt token's share of a step, seconds
        self.fixed_s = 0.0  # t_fixed: what carrying any prompt tokens adds to a step, seconds
        # The last WINDOW prompt-carrying steps as (n prompt tokens, y seconds over t_decode): the
        # points the line is fitted to.
        self._window: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)
        self._fitted = False
        # A decode step of b rows over one-token contexts, seconds, by rows (sorted buckets; a batch
        # takes the smallest bucket >= its rows), or empty; and what a token of context adds.
        self.prior: dict[int, float] = {}
        self.kv_token_s = 0.0
        self.unbounded_steps = 0  # prompt_tokens calls with decodes that returned no bound (metrics)

    def _modelled(self, num_decodes: int, kv_tokens: int) -> float | None:
        """The prior's decode step of `num_decodes` rows over `kv_tokens` tokens of context."""
        if not self.prior or not num_decodes:
            return None
        base = next((s for b, s in self.prior.items() if b >= num_decodes), self.prior[max(self.prior)])
        return base + self.kv_token_s * kv_tokens

    def decode_seconds(self, num_decodes: int, kv_tokens: int = 0) -> float | None:
        """t_decode for a step of `num_decodes` decodes over `kv_tokens` tokens of context:
        modelled and corrected by measurement, else measured, else None."""
        model = self._modelled(num_decodes, kv_tokens)
        return self.decode_s if model is None else model * self.decode_ratio

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float, kv_tokens: int = 0) -> None:
        """One step's shape (its decodes' rows and tokens of context, its prompt tokens) and how
        long it took."""
        if not self.factor or seconds <= 0:
            return
        a = self.alpha
        if num_prompt_tokens == 0:
            if not num_decodes:
                return
            model = self._modelled(num_decodes, kv_tokens)
            if model is not None:  # the first measured step replaces the prior's guess of 1
                ratio = min(seconds / model, self.SPIKE * self.decode_ratio)
                self.decode_ratio = (1 - a) * self.decode_ratio + a * ratio if self._ratio_measured else ratio
                self._ratio_measured = True
            else:
                self.decode_s = seconds if self.decode_s is None else (
                    (1 - a) * self.decode_s + a * min(seconds, self.SPIKE * self.decode_s))
            return
        if num_prompt_tokens < self.min_tokens:
            return  # too few tokens to tell their cost from the step's noise
        base = (self.decode_seconds(num_decodes, kv_tokens) or 0.0) if num_decodes else 0.0
        n, y = float(num_prompt_tokens), max(seconds - base, 0.0)
        if self.per_prompt_token_s:  # what the line expects of n tokens
            y = min(y, self.SPIKE * max(self.fixed_s + self.per_prompt_token_s * n, base))
        self._window.append((n, y))
        mean_n = sum(w[0] for w in self._window) / len(self._window)
        mean_y = sum(w[1] for w in self._window) / len(self._window)
        var = sum((w[0] - mean_n) ** 2 for w in self._window) / len(self._window)
        if var >= (self.SPREAD * mean_n) ** 2:  # sizes spread enough to tell the slope from the intercept
            slope = sum((w[0] - mean_n) * (w[1] - mean_y) for w in self._window) / len(self._window) / var
            if slope > 0:
                self.per_prompt_token_s = slope
                self.fixed_s = max(mean_y - slope * mean_n, 0.0)
                self._fitted = True
                return
        if self._fitted and self.per_prompt_token_s:  # steps of one size: the slope stays, the intercept follows
            self.fixed_s = max(mean_y - self.per_prompt_token_s * mean_n, 0.0)
        else:  # one size of step so far: all of its time per token
            self.per_prompt_token_s = mean_y / mean_n

    def prompt_tokens(self, num_decodes: int, kv_tokens: int = 0) -> int | None:
        """The most prompt tokens a step with `num_decodes` decodes over `kv_tokens` tokens of
        context should carry (None: no bound)."""
        c = self.per_prompt_token_s
        decode_s = self.decode_seconds(num_decodes, kv_tokens)
        if not self.factor or not num_decodes:
            return None
        if decode_s is None or not c:
            self.unbounded_steps += 1
            return None
        within = ((self.factor - 1.0) * decode_s - self.fixed_s) / c
        return max(self.min_tokens, int(self.fixed_s / c + 1e-6), int(within + 1e-6))  # 1e-6: float noise of the means


class StallBudget:
    """Which steps may stall the streams anyway: the few that buy the most throughput.

    A burst of streams, bounded chunk by chunk, is admitted over several times the steps whole
    budgets take; its last arrivals start later and decode in a tail of small batches, and that
    costs the burst throughput. But an inter-token quantile tolerates a share of long gaps: p99
    stays a bounded gap while fewer than one gap in a hundred is a stall. So a step the bound would
    cut may take the whole budget instead when the stalls of the streams in the engine, this
    step's included, stay within `share` of their gaps: those made so far and those expected,
    each stream's min(tokens left to its max_tokens, the mean output of the last HISTORY streams
    that finished). Early in a burst few streams decode,
    so a whole-budget step stalls few gaps: the budget goes where it stalls least. Until a stream
    has finished there is no estimate and no stall: a cold server keeps the plain bound."""

    HISTORY = 256  # finished streams whose mean output length estimates what a stream will make

    def __init__(self, share: float) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"stall share must be in [0, 1), got {share}")
        self.share = share
        self._lengths: deque[int] = deque(maxlen=self.HISTORY)
        self.stall_steps = 0  # steps let past the bound (metrics)

    @property
    def mean_output(self) -> float | None:
        return sum(self._lengths) / len(self._lengths) if self._lengths else None

    def finished(self, num_output_tokens: int) -> None:
        """A stream ended after `num_output_tokens` tokens."""
        self._lengths.append(num_output_tokens)

    def lifts(self, rows: int, prefills: list[tuple[Request, int]], running: Iterable[Request],
              waiting: Iterable[Request], step_tokens: int) -> bool:
        """Whether a step with `rows` streamed decodes may take the whole budget: more prompt tokens
        wait than a whole step (`step_tokens`) holds (the running `prefills`, as (request, tokens
        left), and the `waiting` prompts), and the stalls fit the share."""
        mean = self.mean_output
        if not self.share or mean is None:
            return False
        pending = sum(left for _, left in prefills)
        for request in waiting:  # a backlog, not a prompt or two arriving (Poisson): no stall buys much there
            if pending > step_tokens:
                break
            pending += request.num_remaining_tokens
        if pending <= step_tokens:
            return False
        stalls, gaps = 0, 0.0
        for queue in (running, waiting):
            for r in queue:
                if r.streamed:
                    stalls += r.num_stalls
                    gaps += r.num_output_tokens + min(r.sampling.max_tokens - r.num_output_tokens,
                                                      r.max_model_len - r.num_tokens, mean)
        return stalls + rows <= self.share * gaps

    def charge(self, out: SchedulerOutput, decodes: list[Request], cut: int) -> None:
        """A step was let past the bound, which allowed `cut` prompt tokens: when it carries more,
        each streamed decode in it counts a stall."""
        rows = {id(r) for r in decodes}
        if sum(s.num_new_tokens for s in out.scheduled if id(s.request) not in rows) > cut:
            self.stall_steps += 1
            for r in decodes:
                r.num_stalls += r.streamed
