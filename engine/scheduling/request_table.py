"""Every request in the engine and where it is: waiting in (priority, arrival) order, running in
admission order, and each engine request's sample group by id (the one lookup by id). Requests
leave through here: finished, aborted, failed by an engine fault, or preempted back to the
waiting queue (the scheduler decides when; engine/scheduling/scheduler.py).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from ..messages import RequestOutput, RequestStatus
from .block_manager import BlockManager
from .request import Request, SampleGroup

if TYPE_CHECKING:
    from .adapters import Adapters

log = structlog.get_logger(__name__)


class RequestTable:
    def __init__(self, block_manager: BlockManager, adapters: Adapters | None = None) -> None:
        self.block_manager = block_manager
        self.adapters = adapters  # LoRA slots (engine/scheduling/adapters.py); None: no adapters configured
        # In (priority, arrival) order; preempted requests re-enter in their place.
        self.waiting: deque[Request] = deque()
        # Admission order; the least urgent, latest arrival is preempted first.
        self.running: list[Request] = []
        # Every engine request with an unfinished sample, by its id.
        self.groups: dict[str, SampleGroup] = {}
        self.num_preemptions = 0  # cumulative, for stats

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, group: SampleGroup) -> None:
        """Queue every sample of a new engine request (ValueError for an id in use). Whether it can
        ever fit was checked where it entered the engine (engine.limits.check_request)."""
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        for request in group.samples:
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue after every request of its priority that arrived no later."""
        key = (request.priority, request.arrival_time)
        self.waiting.insert(bisect.bisect_right(self.waiting, key, key=lambda r: (r.priority, r.arrival_time)),
                            request)

    def num_waiting_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for r in self.waiting:
            counts[r.priority] = counts.get(r.priority, 0) + 1
        return counts

    def _pick_victim(self) -> Request:
        """The running request of the least urgent priority that arrived last (ties: admitted
        last). Preempting by arrival, not admission, means a re-admitted old request is never the
        victim of newer ones of its priority: nothing starves within a priority."""
        return max(enumerate(self.running), key=lambda ir: (ir[1].priority, ir[1].arrival_time, ir[0]))[1]

    def _release(self, request: Request) -> None:
        """Gives back what a request holds while it runs: its blocks and its adapter's slot."""
        self.block_manager.free(request)
        self._release_adapter(request)

    def _hold_adapter(self, request: Request) -> bool:
        """Its adapter's slot held for it (loaded into one if needed), or no adapter; False while
        every slot is held by running requests of other adapters (it waits; others may pass)."""
        if request.adapter is None or request.holds_adapter:
            return True
        assert self.adapters is not None, "a request names an adapter, but the engine has no adapter slots"
        request.holds_adapter = self.adapters.acquire(request.adapter)
        return request.holds_adapter

    def _release_adapter(self, request: Request) -> None:
        if request.holds_adapter:
            assert self.adapters is not None and request.adapter is not None
            self.adapters.release(request.adapter)
            request.holds_adapter = False

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.draft_computed = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)  # ahead of everything of its priority that came later
        log.info("preempted", request_id=request.request_id,
                 num_preemptions=request.num_preemptions, num_tokens=request.num_tokens)

    def fail(self, requests: Sequence[Request], error: str, *, out_of_memory: bool = False) -> list[RequestOutput]:
        """Ends each of `requests` (not finished yet) with FINISHED_ERROR: an engine fault in their
        step. Returns their error outputs."""
        outputs = []
        for request in requests:
            if request.finished:
                continue
            last = self.finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(request.error_output(error, out_of_memory=out_of_memory, all_finished=last))
        return outputs

    def finish(self, request: Request, status: RequestStatus) -> bool:
        """Ends one sample (status must be a FINISHED_* one) and gives back its blocks. True when
        it was the last unfinished sample of its engine request (whose id is then free again)."""
        assert status.finished, f"{status.name} is not a finished status"
        if request.finished:
            return False
        request.status = status
        request.spec_token_ids = []
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request)
        group = request.group
        group.num_unfinished -= 1
        if group.num_unfinished:
            return False
        if self.groups.get(group.request_id) is group:
            del self.groups[group.request_id]
        return True

    def abort(self, request_id: str) -> bool:
        """Ends every unfinished sample of the engine request as FINISHED_ABORTED, wherever it is
        (its blocks free at once); False for an unknown or finished id."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        for request in group.samples:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True
