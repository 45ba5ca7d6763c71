"""The continuous-batching scheduler of P1: who computes which tokens in the next step.

One pass (:meth:`Scheduler.schedule`) first continues the running requests in priority order
(earliest arrival first), then admits waiting requests first-come first-served, within a
per-step token budget (chunked prefill), ``max_num_seqs`` and an encoder compute budget. The
caller runs the step, then hands the sampled tokens to :meth:`Scheduler.update_from_output`
(``step_update.py``, the scheduler's base class: the output half).
The scheduler owns the queues and the policy; it *uses* a :class:`KVCacheManager` (blocks and
the prefix cache) and an :class:`EncoderCacheManager` (encoder-output slots), and hands the
runner one :class:`SchedulerOutput` (``sched_output.py``).

Invariants:
- Every live request is in ``requests`` and in exactly one of ``waiting`` (FCFS; preempted
  requests re-enter at the front) or ``running`` (sorted by ``Request.priority_key``, i.e.
  arrival order, so ``running[-1]`` is always the latest arrival).
- When KV blocks run out, the latest-arrived request not yet scheduled in this pass is
  preempted (recompute: its blocks and encoder references are released, ``num_computed_tokens
  = 0``, output tokens kept, it goes to the front of ``waiting``). No request is admitted in a
  pass that preempted one.
- A chunk's range is trimmed around its request's items and their encoder runs reserved by
  ``engine/scheduling/encoder_plan.py`` (an item is encoded whole by the first chunk that reaches
  it, so a 12 MP photo's placeholder range may be split across chunks; with ``whole_mm_spans`` a
  chunk never ends inside an item); a chunk not scheduled after all is rolled back exactly.
- At most ``max_loras`` distinct LoRA adapters are among the running requests (a waiting
  request under another adapter waits at the head of ``waiting``), so each step's adapters fit
  the runner's device slots (``engine/lora/``).
- A prefix-cache hit sets ``num_computed_tokens`` to the hit length at admission: those tokens
  (and the encoder runs of items they cover) are skipped.
- A request that can never be scheduled (prompt beyond ``max_model_len`` or the KV pool, an
  item larger than the encoder cache or a step's budgets: :func:`never_schedulable`) finishes
  with a typed error, delivered as an output by the next ``update_from_output``; the others
  keep being scheduled.
- Leaving ``running`` other than by preemption (finish, abort, rejection) releases the
  request's KV blocks and encoder references, removes it from ``requests`` and reports its id
  once in the next pass's ``finished_request_ids``. Encoder references are also released once
  the request's computed tokens pass an item.
- ``num_computed_tokens`` advances when a chunk is scheduled; KV blocks are registered in the
  prefix cache in ``update_from_output``, after the step computed them, up to that step's
  chunk end (never past the tokens known on the host: keys come from real tokens).
- Async scheduling (``engine/core.py``; :attr:`Scheduler.async_scheduling`, set by the core):
  a pass may run while the previous step is in flight. A running request whose last row
  sampled a token not yet updated (its *placeholder*: ``num_computed_tokens >= num_tokens``,
  ``request.py``) gets the row after it: one decode token, :data:`PLACEHOLDER_TOKEN` in
  ``token_ids``, listed in ``pending_rows`` with its row among the previous pass's sampled rows
  (the scheduler keeps each pass's sampled request ids; in the steady state both lists are
  ``sched_output.identity``); the step's update turns the placeholder into the
  real token (the only place tokens are appended). A request whose placeholder will end it
  for sure (``max_tokens``, ``max_model_len``) gets no further row; one that the update
  finishes (a stop id, EOS) had its next row computed for nothing: that row's token is
  dropped (the request is gone by its update) and its blocks were freed by the finish. A
  request preempted while its token was in flight still gets that token from the update (it
  may end it there, in ``waiting``), as the synchronous loop would have given it before the
  pass. Off (the synchronous loop: every update runs before the next pass) no row ever holds
  a placeholder and no per-pass state is kept.
- Importable and runnable without torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable, Sequence

from mmis.engine.scheduling.encoder_cache import EncoderCacheManager
from mmis.engine.scheduling.encoder_plan import Budget, EncoderPlan, plan_chunk, rollback
from mmis.engine.scheduling.kv_cache import KVCacheManager
from mmis.engine.scheduling.request import InvalidRequestError, Request, RequestStatus
from mmis.engine.scheduling.sched_config import SchedulerConfig, never_schedulable
from mmis.engine.scheduling.sched_output import (
    PLACEHOLDER_TOKEN,
    MultiModalInput,
    ScheduledRequest,
    SchedulerOutput,
    identity,
)
from mmis.engine.scheduling.step_update import StepUpdate, wire_output
from mmis.protocol.messages import EngineCoreOutput, ErrorCode, FinishReason, RequestError

new_row = tuple.__new__  # builds a ScheduledRequest (a named tuple) from its field values
_PLACEHOLDER_CHUNK = (PLACEHOLDER_TOKEN,)  # a decode row over the step in flight's token


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    encoder_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_rejected: int


class Scheduler(StepUpdate):
    """Schedules each step (this module) and applies its outputs (:class:`StepUpdate`)."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        kv: KVCacheManager | None = None,
        encoder_cache: EncoderCacheManager | None = None,
    ) -> None:
        self.config = cfg = config or SchedulerConfig()
        self.kv = kv or KVCacheManager(
            cfg.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching
        )
        self.encoder_cache = encoder_cache or EncoderCacheManager(cfg.encoder_cache_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._pending_outputs: list[EngineCoreOutput] = []
        self._seq = itertools.count()
        self._step = 0
        # set by the core when a pass may run before the previous step's update (async)
        self.async_scheduling = False
        # async: the ids of this pass's sampled rows (the runner's order) and the last pass's,
        # and whether a sampled row's request is not overlappable
        self._sampled_ids: list[str] = []
        self._prev_sampled_ids: list[str] = []
        self._blocked = False
        self.num_preemptions = 0
        self.num_rejected = 0

    # -- intake and queries ------------------------------------------------------------------

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
        """Finish a request from outside (abort, failed step). False if it is unknown/done."""
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

    def has_pending_outputs(self) -> bool:
        return bool(self._pending_outputs)

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

    # -- one pass ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        budget = Budget(self.config.max_num_batched_tokens, self.config.encoder_compute_budget)
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        pending: list[str] = []  # the request ids of the rows over a placeholder, in order
        if self.async_scheduling:
            self._prev_sampled_ids, self._sampled_ids = self._sampled_ids, []
        self._blocked = False
        self._schedule_running(budget, scheduled, preempted, pending, self.async_scheduling)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        rows, sources = self._pending_rows(scheduled, pending) if pending else ((), ())
        out = SchedulerOutput(
            scheduled=scheduled,
            freed_encoder_hashes=self.encoder_cache.take_freed(),
            finished_request_ids=self._finished_ids,
            preempted_request_ids=preempted,
            step=self._step,
            pending_rows=rows,
            pending_sources=sources,
            needs_update_first=self._blocked,
        )
        self._finished_ids = []
        return out

    def _schedule_running(
        self,
        budget: Budget,
        scheduled: list[ScheduledRequest],
        preempted: list[str],
        pending: list[str],
        ahead_on: bool,
    ) -> None:
        """Schedule the running requests in order (one row each while the token budget lasts;
        preempting from the back when blocks run out). The token budget is kept in a local
        (``left``, one attribute write per row less on the decode path): ``budget.tokens`` is
        brought up to date before every call that reads or spends it (encoder planning,
        ``_commit``) and on return."""
        running, kv = self.running, self.kv
        held = kv.block_ids  # a request's persistent block ids
        limit = self.config.max_model_len or float("inf")
        append = scheduled.append
        left = budget.tokens
        count = len(running)  # changes only where a request is preempted (below)
        i = 0
        while i < count and left > 0:
            request = running[i]
            start = request.num_computed_tokens
            tokens = request.all_token_ids
            total = len(tokens)
            if start >= total and request.pooling_params is None:  # a placeholder (async)
                total = start + 1
                if total >= request.length_cap or total >= limit:  # that token ends it
                    i += 1
                    continue
            num_new = total - start
            if num_new > left:
                num_new = left
            plan: EncoderPlan | None = None
            if start < request.mm_end:  # an item may still be ahead: plan its encoder run
                budget.tokens = left
                plan = self._plan_encoder(request, start, num_new, budget)
                num_new = plan.num_new_tokens
            # else every item lies behind the chunk: the plan would be the tokens alone
            if num_new == 0:
                if plan is not None:
                    self._rollback(request, plan)
                i += 1
                continue
            # most decode steps fit in the held blocks, where allocate_slots would do nothing
            table = held.get(request.request_id) if start + num_new <= request.kv_capacity else None
            while table is None and (table := kv.allocate_slots(request, num_new)) is None:
                victim = running[-1]
                if victim is request:
                    if plan is not None:
                        self._rollback(request, plan)
                    break
                self._preempt(victim, preempted)
                count -= 1
            if table is None:
                self._preempt(request, preempted)  # it was the latest-arrived: nothing after it
                break
            if plan is not None:
                budget.tokens = left
                append(self._commit(request, plan, num_new, budget, is_new=False))
                left = budget.tokens
                i += 1
                continue
            # _commit without encoder runs, inlined (every decode row)
            end = start + num_new
            request.num_computed_tokens = end
            left -= num_new
            chunk: Sequence[int] = tokens[start:end]
            if ahead_on:
                if end > len(tokens):  # its token is the step in flight's: a placeholder
                    chunk = _PLACEHOLDER_CHUNK  # start == len(tokens): one step in flight
                    pending.append(request.request_id)
                if end == total and request.pooling_params is None:
                    self._sampled_ids.append(request.request_id)
                    if not request.plain and not request.overlappable:
                        self._blocked = True
            append(
                new_row(  # ScheduledRequest(...) without its Python-level __new__
                    ScheduledRequest,
                    (
                        request.request_id,
                        chunk,
                        start,
                        table,
                        request.mm_items,  # every item starts before the chunk
                        end == total,
                        request.sampling_params,
                        request.pooling_params,
                        False,
                        (),
                        request.plain,
                        request.lora_name,
                    ),
                )
            )
            i += 1
        budget.tokens = left

    def _lora_fits(self, name: str) -> bool:
        """Whether a request under adapter ``name`` may run beside the running ones: at most
        ``max_loras`` distinct adapters run at once, so every step's fit the device slots."""
        names = {r.lora_name for r in self.running if r.lora_name is not None}
        return name in names or len(names) < self.config.max_loras

    def _schedule_waiting(self, budget: Budget, scheduled: list[ScheduledRequest]) -> None:
        while self.waiting and budget.tokens > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            problem = never_schedulable(self.config, request)
            if problem is not None:
                self._reject_head(*problem)
                continue
            if request.lora_name is not None and not self._lora_fits(request.lora_name):
                break  # FCFS: it waits for a running adapter's requests to finish
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget.tokens)
            plan = self._plan_encoder(request, num_hit, num_new, budget)
            if plan.num_new_tokens == 0:
                self._rollback(request, plan)
                break
            if not self.kv.can_ever_fit(request.num_tokens):
                self._rollback(request, plan)
                self._reject_head_kv_overflow()
                continue
            if self.kv.allocate_slots(request, plan.num_new_tokens, hit_blocks) is None:
                self._rollback(request, plan)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.priority_key)
            request.num_computed_tokens = num_hit
            if not request.skip_cache:
                self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            scheduled.append(self._commit(request, plan, plan.num_new_tokens, budget, is_new=True))

    def _pending_rows(
        self, scheduled: Sequence[ScheduledRequest], pending: list[str]
    ) -> tuple[Sequence[int], Sequence[int]]:
        """``pending_rows`` and ``pending_sources`` of a pass whose rows over a placeholder are
        those of ``pending`` (request ids, in schedule order): shared identity lists in the
        steady state (every row pending, in the last pass's sampled order)."""
        count = len(pending)
        if count == len(scheduled):
            rows: Sequence[int] = identity(count)
        else:
            rows = [k for k, row in enumerate(scheduled) if row[1] is _PLACEHOLDER_CHUNK]
        prev = self._prev_sampled_ids
        if prev[:count] == pending:
            return rows, identity(count)
        where = {rid: k for k, rid in enumerate(prev)}
        return rows, [where[rid] for rid in pending]

    def _plan_encoder(
        self, request: Request, start: int, num_new: int, budget: Budget
    ) -> EncoderPlan:
        return plan_chunk(self.encoder_cache, self.config, request, start, num_new, budget)

    def _rollback(self, request: Request, plan: EncoderPlan) -> None:
        rollback(self.encoder_cache, request, plan)

    def _commit(
        self,
        request: Request,
        plan: EncoderPlan | None,
        num_new: int,
        budget: Budget,
        *,
        is_new: bool,
    ) -> ScheduledRequest:
        """Schedule ``num_new`` tokens of ``request`` (``plan``: its encoder runs; ``None``
        when no item lies at or after the chunk's start). Such a chunk never holds a
        placeholder: an admission follows its request's update, and a chunk with encoder
        work lies inside the prompt."""
        start = request.num_computed_tokens
        end = start + num_new
        request.num_computed_tokens = end
        budget.tokens -= num_new
        sample = end == request.num_tokens
        if sample and self.async_scheduling and request.pooling_params is None:
            self._sampled_ids.append(request.request_id)
            if not request.plain and not request.overlappable:
                self._blocked = True
        items: Sequence[MultiModalInput]
        encoder_inputs: list[int] = []
        if plan is not None and plan.encoder_inputs:
            budget.encoder -= plan.encoder_tokens
            # the items up to the chunk's end; tensors only for this step's encoder runs (the
            # request keeps its full features: a preempted request may need them again)
            encode = set(plan.encoder_inputs)
            items = []
            for idx, item in enumerate(request.mm_items):
                if item.offset >= end:
                    continue
                if idx in encode:
                    data = request.mm_features[idx].data
                    encoder_inputs.append(len(items))
                    item = dataclasses.replace(item, data=data if isinstance(data, dict) else None)
                items.append(item)
        elif end >= request.mm_end:  # every item starts before the end: all of them, as they are
            items = request.mm_items
        else:
            items = [item for item in request.mm_items if item.offset < end]
        return ScheduledRequest(
            request.request_id,
            request.all_token_ids[start:end],
            start,
            self.kv.block_table(request.request_id),
            items,
            sample,
            request.sampling_params,
            request.pooling_params,
            is_new,
            encoder_inputs,
            request.plain,
            request.lora_name,
        )

    # -- transitions -------------------------------------------------------------------------

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
            f"the prompt has {request.num_tokens} tokens; the KV cache holds {capacity} "
            "(raise it with --kv-cache-gb or --num-kv-blocks)",
        )

    def _end_by_scheduler(self, request: Request) -> None:
        self.num_rejected += 1
        self._pending_outputs.append(wire_output(request, []))
        self._release(request)
