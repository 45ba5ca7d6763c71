"""The scheduler's output half: a step's sampled tokens applied to its requests.

:class:`StepUpdate` is the part of :class:`~mmis.engine.scheduling.scheduler.Scheduler` (its
base class) that runs after a step: :meth:`StepUpdate.update_from_output` appends each sampled
token, registers the KV blocks the step completed in the prefix cache, releases the encoder
references of the items it passed, finishes the requests that ended and returns their wire
outputs. The pass that schedules a step is ``scheduler.py``; the two share the scheduler's
state (the attributes declared below, made by ``Scheduler.__init__``).

Invariants (the scheduler's, ``scheduler.py``'s module docstring, for this half):
- Tokens are appended here only: a placeholder row of async scheduling becomes its real token
  in the update of its step, and a request preempted while its token was in flight still
  gets it (:meth:`StepUpdate._token_after_preemption`).
- KV blocks are registered in the prefix cache after the step that computed them, up to that
  step's chunk end, and only when the chunk crossed a block boundary.
- A mismatch between the step's rows and the tokens it sampled raises
  :class:`SchedulerError` (an engine bug): no token is given to another request.
- Leaving ``running`` releases the request's KV blocks and encoder references, removes it
  from ``requests`` and reports its id once in the next pass's ``finished_request_ids``.
- Importable and runnable without torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from mmis.engine.scheduling.encoder_cache import EncoderCacheManager
from mmis.engine.scheduling.kv_cache import KVCacheManager
from mmis.engine.scheduling.request import Request, RequestStatus
from mmis.engine.scheduling.sched_config import SchedulerConfig
from mmis.engine.scheduling.sched_output import ScheduledRequest, SchedulerOutput
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import EngineCoreOutput, FinishReason


class SchedulerError(MMISError):
    """The runner's results do not match what was scheduled (an engine bug, not user input)."""


def _spread(scheduled: Sequence[ScheduledRequest], sampled: Sequence[int]) -> list[int | None]:
    """``sampled`` (one token per chunk that samples: ``sample`` set, no pooling) placed
    beside its chunk, ``None`` beside the others; a count that does not match raises."""
    tokens = iter(sampled)
    out = [
        next(tokens, None) if item.sample and item.pooling_params is None else None
        for item in scheduled
    ]
    if next(tokens, None) is not None:
        raise SchedulerError(f"{len(sampled)} sampled tokens for a step that sampled fewer")
    return out


def wire_output(request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
    """The wire output of ``request`` after it gained ``new_token_ids`` (its end, if ended)."""
    reason = request.finish_reason
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=None if reason is None else reason.value,
        error=request.error,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        stop_reason=request.stop_reason,
    )


class StepUpdate:
    """A step's update of the scheduler's requests (see the module docstring)."""

    config: SchedulerConfig
    kv: KVCacheManager
    encoder_cache: EncoderCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    async_scheduling: bool
    _finished_ids: list[str]
    _pending_outputs: list[EngineCoreOutput]

    def update_from_output(
        self, sched_out: SchedulerOutput, sampled: Sequence[int]
    ) -> list[EngineCoreOutput]:
        """Apply a step's sampled tokens; returns one wire output per request that progressed
        or ended (also for requests rejected by the pass). Requests aborted since the pass are
        skipped.

        ``sampled`` holds one token per scheduled chunk that samples (``sample`` set, no
        ``pooling_params``: the rows ``runner.py`` samples), in schedule order. A chunk's
        full KV blocks are registered in the prefix cache only when it crossed a block
        boundary: every earlier update registered every block full by then (a prefix hit
        registers its blocks at admission, ``kv_cache.py``), so a chunk inside one block
        completes none. Each sampled token fills its request's placeholder (async
        scheduling: the next pass may already have scheduled a row after it).
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        requests, cache_blocks = self.requests, self.kv.cache_computed_blocks
        bs, limit = self.kv.block_size, self.config.max_model_len or float("inf")
        running, finished = RequestStatus.RUNNING, RequestStatus.FINISHED
        scheduled, ahead = sched_out.scheduled, self.async_scheduling
        if len(sampled) == len(scheduled):  # every chunk sampled (every decode step)
            pairs: Iterable[tuple[ScheduledRequest, int | None]] = zip(
                scheduled, sampled, strict=True
            )
        else:
            pairs = zip(scheduled, _spread(scheduled, sampled), strict=True)
        for item, token in pairs:
            if token is None or not item.sample or item.pooling_params is not None:
                self._update_unsampled(item, token, outputs)  # a prefill chunk, pooling, an error
                continue
            request = requests.get(item.request_id)
            if request is None:
                continue
            if request.status is not running:
                if request.status is RequestStatus.PREEMPTED:
                    # preempted by a pass that ran while this step was in flight (async)
                    outputs.append(self._token_after_preemption(request, token))
                continue
            # the chunk's end: where the pass left the request, unless a later pass (async
            # scheduling, one step ahead) has moved it on since
            end = (
                item.start_position + len(item.token_ids) if ahead else request.num_computed_tokens
            )
            if item.start_position // bs != end // bs:
                cache_blocks(request, end)  # the chunk completed a block
            if request.mm_features:
                self._release_passed_items(request, end)
            if request.constraint is None:  # append_output_token, inlined (every row)
                request.output_token_ids.append(token)
                tokens = request.all_token_ids
                tokens.append(token)
                size = len(tokens)
            else:
                request.append_output_token(token)
                size = len(request.all_token_ids)
            if (
                token in request.stop_ids
                or size >= request.length_cap
                or request.constraint is not None
            ):
                request.check_stop(token)  # else it cannot stop this request
            if size >= limit and request.status is running:
                request.finish(FinishReason.LENGTH)
            if request.status is finished:
                outputs.append(wire_output(request, [token]))
                self._finish_running(request)
            else:  # _output of a running request: no reason, error or stop reason yet
                outputs.append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[token],
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_cached_tokens=request.num_cached_tokens,  # set (>= 0) at admission
                    )
                )
        return outputs

    def _update_unsampled(
        self, item: ScheduledRequest, token: int | None, outputs: list[EngineCoreOutput]
    ) -> None:
        """:meth:`update_from_output` of a row that is not a sampled decode or last chunk: a
        chunk short of its prompt's end, a pooling request's prompt (it finishes), or a
        mismatch between the step's rows and its tokens (:class:`SchedulerError`)."""
        if token is not None:
            raise SchedulerError(f"a sampled token for {item.request_id!r}, which did not sample")
        request = self.requests.get(item.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return
        end = item.start_position + len(item.token_ids)
        if item.start_position // self.kv.block_size != end // self.kv.block_size:
            self.kv.cache_computed_blocks(request, end)  # the chunk completed a block
        if request.mm_features:
            self._release_passed_items(request, end)
        if not item.sample:
            return
        if item.pooling_params is None:
            raise SchedulerError(f"no sampled token for scheduled request {item.request_id!r}")
        request.finish(FinishReason.STOP)  # a pooling request: done after its prompt
        outputs.append(wire_output(request, []))
        self._finish_running(request)

    def _release_passed_items(self, request: Request, computed: int) -> None:
        """Release the encoder references of the items before ``computed`` (a step's end)."""
        for item in request.mm_items:  # keyed as the encoder cache holds them (engine/lora/)
            if item.end <= computed:
                self.encoder_cache.release(request.request_id, item.mm_hash)

    def _token_after_preemption(self, request: Request, token: int) -> EngineCoreOutput:
        """Append the token a step in flight sampled for ``request``, preempted since (it is
        in ``waiting``): what the synchronous loop appended before that pass; it may end the
        request there."""
        request.append_output_token(token)
        if not request.check_stop(token):
            limit = self.config.max_model_len
            if limit is not None and request.num_tokens >= limit:
                request.finish(FinishReason.LENGTH)
        if request.status is RequestStatus.FINISHED:
            self.waiting.remove(request)
            self._release(request)
            return wire_output(request, [token])
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _finish_running(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self.encoder_cache.release_all(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
