"""The continuous-batching scheduler of P1: who computes which tokens in the next step.

One pass (:meth:`Scheduler.schedule`) first continues the running requests in priority order
(earliest arrival first), then admits waiting requests first-come first-served, within a
per-step token budget (chunked prefill), ``max_num_seqs`` and an encoder compute budget. The
caller runs the step, then hands the sampled tokens to :meth:`Scheduler.update_from_output`.
Queues, lifecycle transitions and what they release live in ``request_queue``; encoder
planning in ``encoder_plan``.

Invariants:
- ``running`` is sorted by arrival (``Request.priority_key``); when KV blocks run out, the
  latest-arrived request not yet scheduled in this pass is preempted (recompute: its blocks and
  encoder references are released, it goes to the front of ``waiting``). No request is
  admitted in a pass that preempted one.
- An image's encoder run is scheduled only in the chunk that reaches its placeholder range and
  only if its output is not cached; a chunk never splits the range of an uncached item: it
  covers the whole range or stops before it.
- A prefix-cache hit sets ``num_computed_tokens`` to the hit length at admission: those tokens
  (and the encoder runs of items they cover) are skipped.
- A request that can never be scheduled (prompt beyond ``max_model_len`` or the KV pool, an
  item larger than the encoder cache or a step's budgets) finishes with a typed error; the
  others keep being scheduled.
- Encoder references are released when the request's computed tokens pass an item, or when it
  finishes, is aborted or is preempted; KV blocks when it finishes, is aborted or preempted.
- ``num_computed_tokens`` advances when a chunk is scheduled; KV blocks are registered in the
  prefix cache in ``update_from_output``, after the step computed them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from mmis.engine.encoder_plan import EncoderPlan, plan_encoder, rollback_plan
from mmis.engine.request import Request, RequestStatus
from mmis.engine.request_queue import RequestQueue
from mmis.engine.sched_config import SchedulerConfig, never_schedulable
from mmis.engine.sched_output import (
    RequestEvent,
    ScheduledRequest,
    SchedulerOutput,
)
from mmis.multimodal.payload_strip import strip_covered_payloads
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import FinishReason


class SchedulerError(MMISError):
    """The runner's results do not match what was scheduled (an engine bug, not user input)."""


@dataclasses.dataclass
class _Budget:
    tokens: int
    encoder: int


class Scheduler(RequestQueue):
    """Queues and lifecycle come from :class:`RequestQueue`; this adds the pass itself."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self._step = 0

    # -- one pass ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        budget = _Budget(self.config.max_num_batched_tokens, self.config.encoder_compute_budget)
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        out = SchedulerOutput(
            step=self._step,
            scheduled=scheduled,
            freed_encoder_hashes=self.encoder_cache.take_freed(),
            finished_request_ids=self._finished_ids,
            preempted_request_ids=preempted,
        )
        self._finished_ids = []
        return out

    def _schedule_running(
        self, budget: _Budget, scheduled: list[ScheduledRequest], preempted: list[str]
    ) -> None:
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget.tokens)
            plan = plan_encoder(
                self.encoder_cache, request, request.num_computed_tokens, num_new, budget.encoder
            )
            if plan.num_new_tokens == 0:
                rollback_plan(self.encoder_cache, request, plan)
                i += 1
                continue
            while self.kv.allocate_slots(request, plan.num_new_tokens) is None:
                victim = self.running[-1]
                if victim is request:
                    rollback_plan(self.encoder_cache, request, plan)
                    break
                self._preempt(victim, preempted)
            else:
                scheduled.append(self._commit(request, plan, budget, is_new=False))
                i += 1
                continue
            self._preempt(request, preempted)  # it was the latest-arrived: nothing after it
            break

    def _schedule_waiting(self, budget: _Budget, scheduled: list[ScheduledRequest]) -> None:
        while self.waiting and budget.tokens > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            problem = never_schedulable(self.config, request)
            if problem is not None:
                self._reject_head(*problem)
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget.tokens)
            plan = plan_encoder(self.encoder_cache, request, num_hit, num_new, budget.encoder)
            if plan.num_new_tokens == 0:
                rollback_plan(self.encoder_cache, request, plan)
                break
            if not self.kv.can_ever_fit(request.num_tokens):
                rollback_plan(self.encoder_cache, request, plan)
                self._reject_head_kv_overflow()
                continue
            if self.kv.allocate_slots(request, plan.num_new_tokens, hit_blocks) is None:
                rollback_plan(self.encoder_cache, request, plan)
                break
            self._admit(request)
            request.num_computed_tokens = num_hit
            self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            scheduled.append(self._commit(request, plan, budget, is_new=True))

    def _commit(
        self, request: Request, plan: EncoderPlan, budget: _Budget, *, is_new: bool
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_new = plan.num_new_tokens
        request.num_computed_tokens = start + num_new
        budget.tokens -= num_new
        budget.encoder -= plan.encoder_tokens
        features = request.mm_features
        if is_new and start > 0 and features:
            # S7: a prefix hit covers these items, no encoder run can need their tensors; the
            # Request keeps the full features (a preempted request may need them again), and
            # SHM descriptors survive so the receiver still balances its reference counts
            features = strip_covered_payloads(features, start, keep=self.config.strip_keep_fields)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_table=self.kv.block_table(request.request_id),
            encoder_inputs=plan.encoder_inputs,
            mm_features=features,
            sampling_params=request.sampling_params,
            pooling_params=request.pooling_params,
            is_new=is_new,
            sample=request.num_computed_tokens == request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
        )

    # -- after the step ----------------------------------------------------------------------

    def update_from_output(
        self, sched_out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestEvent]:
        """Apply a step's sampled tokens; returns progress/finish events (also for requests
        rejected by the pass). Requests aborted since the pass are skipped."""
        events, self._pending_events = self._pending_events, []
        for item in sched_out.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            self.kv.cache_computed_blocks(request)
            self._release_passed_items(request)
            if not item.sample:
                continue
            if request.is_pooling:
                request.finish(FinishReason.STOP)
                events.append(RequestEvent.from_request(request, []))
                self._finish_running(request)
                continue
            tokens = sampled.get(item.request_id)
            if not tokens:
                raise SchedulerError(f"no sampled token for scheduled request {item.request_id!r}")
            new_tokens = []
            for token in tokens:
                request.append_output_token_ids([token])
                new_tokens.append(token)
                if request.check_stop(token):
                    break
                limit = self.config.max_model_len
                if limit is not None and request.num_tokens >= limit:
                    request.finish(FinishReason.LENGTH)
                    break
            events.append(RequestEvent.from_request(request, new_tokens))
            if request.is_finished:
                self._finish_running(request)
        return events

    def _release_passed_items(self, request: Request) -> None:
        for feature in request.mm_features:
            placeholder = feature.placeholder
            if placeholder.offset + placeholder.length <= request.num_computed_tokens:
                self.encoder_cache.release(request.request_id, feature.mm_hash)
