"""The scheduler's request bookkeeping: queues, lifecycle transitions and what they release.

Invariants:
- Every live request is in ``requests`` and in exactly one of ``waiting`` (FCFS; preempted
  requests re-enter at the front) or ``running`` (sorted by ``Request.priority_key``, i.e.
  arrival order, so ``running[-1]`` is always the latest arrival).
- Leaving ``running`` other than by preemption (finish, abort, rejection) releases the
  request's KV blocks and encoder references, removes it from ``requests`` and reports its id
  once in the next pass's ``finished_request_ids``.
- Preemption releases the same resources but keeps the request (status PREEMPTED,
  ``num_computed_tokens = 0``, output tokens kept) for recomputation.
- Requests finished by the scheduler itself (rejections) produce a terminal
  :class:`RequestEvent`, delivered by the next ``update_from_output``.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable

from mmis.engine.encoder_cache import EncoderCacheManager
from mmis.engine.kv_cache import KVCacheManager
from mmis.engine.request import InvalidRequestError, Request, RequestStatus
from mmis.engine.sched_config import SchedulerConfig
from mmis.engine.sched_output import RequestEvent, SchedulerStats
from mmis.protocol.messages import ErrorCode, FinishReason, RequestError


class RequestQueue:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        cfg = self.config
        self.kv = KVCacheManager(
            cfg.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching
        )
        self.encoder_cache = EncoderCacheManager(cfg.encoder_cache_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._pending_events: list[RequestEvent] = []
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.num_rejected = 0

    # -- public ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise InvalidRequestError(f"{request!r} is not a fresh request")
        request.seq = next(self._seq)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, reason: FinishReason, *, stop_reason: int | str | None = None
    ) -> bool:
        """Finish a request from outside (stop string, abort). False if it is unknown/done."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.finish(reason, stop_reason=stop_reason)
        self._release(request)
        return True

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort waiting or running requests; returns those that were still live."""
        return [rid for rid in request_ids if self.finish_request(rid, FinishReason.ABORT)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_events(self) -> bool:
        return bool(self._pending_events)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage(),
            encoder_cache_usage=self.encoder_cache.usage(),
            prefix_cache_queries=self.kv.prefix_stats.queries,
            prefix_cache_hits=self.kv.prefix_stats.hits,
            num_preemptions=self.num_preemptions,
            num_rejected=self.num_rejected,
        )

    # -- transitions -------------------------------------------------------------------------

    def _admit(self, request: Request) -> None:
        """waiting[0] -> running (its KV slots are allocated by the caller)."""
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.priority_key)

    def _preempt(self, request: Request, preempted: list[str]) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self.encoder_cache.release_all(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        preempted.append(request.request_id)

    def _finish_running(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self.encoder_cache.release_all(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _reject_head(self, code: ErrorCode, message: str) -> None:
        """waiting[0] can never be scheduled: finish it with a typed, non-retryable error."""
        request = self.waiting.popleft()
        request.finish(FinishReason.ERROR, error=RequestError(code.value, message, False))
        self._end_by_scheduler(request)

    def _reject_head_kv_overflow(self) -> None:
        request = self.waiting[0]
        if request.num_output_tokens:  # it grew past the pool while running: stop it there
            self.waiting.popleft()
            request.finish(FinishReason.LENGTH)
            self._end_by_scheduler(request)
            return
        capacity = self.kv.num_usable_blocks * self.kv.block_size
        self._reject_head(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has {request.num_tokens} tokens; the KV cache holds {capacity}",
        )

    def _end_by_scheduler(self, request: Request) -> None:
        self.num_rejected += 1
        self._pending_events.append(RequestEvent.from_request(request, []))
        self._release(request)
