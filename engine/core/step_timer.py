"""How long each step took, for the stall bound (engine/scheduling/stall.py) and the metrics
(`pie_step_duration_seconds`).

A step's time is the time between its end and the previous step's, counted only while the engine
was busy in between, with the step's shape (decode rows, prompt tokens, the decodes' context)
beside it. On CUDA both ends are events the steps recorded after their last work, read off the
device: the host's clock sees a step end only when it reads it back, which under async scheduling
can be long after (the next step's launch runs first), and so would credit a long prompt step's
time to the step before it.
"""

from __future__ import annotations

import time

import torch

from ..messages import StepTimes
from ..runner.pending import PendingStep
from ..scheduling.stall import StallBound
from ..scheduling.step import SchedulerOutput


class StepTimer:
    def __init__(self, stall: StallBound, times: StepTimes) -> None:
        self._stall = stall
        self._times = times
        self._shape: tuple[int, int, int] | None = None  # of the step in flight; None: not timed
        self._last_done: float | torch.cuda.Event | None = None  # the last step's end: a time, or its event on CUDA

    def launched(self, out: SchedulerOutput, pending: PendingStep | None) -> None:
        """The step in flight is `out`, launched as `pending`. A step with proposals is not timed:
        its time does not follow the stall bound's model."""
        if pending is None or out.num_spec_tokens:
            self._shape = None
            return
        decodes = [s.start + 1 for s in out.scheduled if s.num_new_tokens == 1]
        self._shape = len(decodes), out.num_batched_tokens - len(decodes), sum(decodes)

    def idle(self) -> None:
        """Nothing ran: the next step's time is no step's alone."""
        self._last_done = None

    def done(self, event: torch.cuda.Event | None) -> None:
        """The step in flight is read back; `event` was recorded after its last work (None on the CPU)."""
        now = time.monotonic()
        if self._last_done is not None and self._shape is not None:
            decodes, prompt_tokens, context = self._shape
            last = self._last_done
            if isinstance(last, torch.cuda.Event):
                seconds = last.elapsed_time(event) / 1e3 if event is not None else 0.0
            else:
                seconds = now - last
            self._stall.observe(decodes, prompt_tokens, seconds, context)
            self._times.observe(prompt_tokens, seconds)
        self._last_done = now if event is None else event
