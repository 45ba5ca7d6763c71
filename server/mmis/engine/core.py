"""The engine core: scheduler + model runner + stop strings, one step at a time.

Invariants:
- Only the busy-loop thread calls into this object (see :mod:`core_process`).
- A request that cannot run (bad token ids, too long for the context, bad parameters, item
  tensors that do not match their placeholder; see :mod:`admission`) is answered with a
  ``finish_reason="error"`` output at admission and never reaches the scheduler.
- Safety net: if the runner still fails a step, that step's requests (one error per parent)
  end with an error output, encoder entries it never stored are dropped, and the engine
  keeps serving; :meth:`step` never raises for anything a client sent.
- ``n > 1`` fans out into ``n`` child requests (``<id>#<i>``) whose outputs carry the
  parent's id and ``index = i``; aborting the parent aborts every child.
- Stop strings are matched here on the detokenized output (the tokenizer is the model's);
  the request finishes with ``stop_reason`` = the matched string and P0 trims the text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from mmis.engine.admission import MAX_N, ModelLimits, Problem, check_request
from mmis.engine.request import Request
from mmis.engine.runner import ModelRunner
from mmis.engine.sched_output import RequestEvent, SchedulerOutput, to_step_batch
from mmis.engine.scheduler import Scheduler
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
)
from mmis.telemetry.engine_stats import EngineStats

if TYPE_CHECKING:
    from mmis.telemetry.request_spans import RequestSpans

log = logging.getLogger(__name__)

__all__ = ["MAX_N", "EngineCore"]

_CHILD = "#"


def _error(request_id: str, code: ErrorCode, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request_id,
        finish_reason=FinishReason.ERROR.value,
        error=RequestError(code=code.value, message=message, retryable=False),
    )


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        *,
        tokenizer: Any = None,
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
        spans: RequestSpans | None = None,
    ) -> None:
        self.spans = spans  # P1 tracing (None when off): see telemetry.request_spans
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.vocab_size = int(runner.adapter.vocab_size)
        self.limits = ModelLimits(self.vocab_size, max_model_len)
        self._children: dict[str, list[str]] = {}  # parent id -> live child ids
        self._immediate: list[EngineCoreOutput] = []
        self.num_steps = 0

    # ------------------------------------------------------------------ intake
    def add_request(
        self, request: EngineCoreRequest, mm_inputs: Sequence[dict[str, np.ndarray] | None]
    ) -> None:
        """Admit ``request`` (or answer it with an error output); never raises for bad input."""
        problem = check_request(request, mm_inputs, self.limits, self.runner.adapter)
        if problem is None and (
            request.request_id in self.scheduler.requests or request.request_id in self._children
        ):
            problem = Problem(
                ErrorCode.INVALID_REQUEST, f"request id {request.request_id!r} is in use"
            )
        if problem is not None:
            self._immediate.append(_error(request.request_id, problem.code, problem.message))
            return
        features = [
            feature if data is None else msgspec.structs.replace(feature, data=data)
            for feature, data in zip(request.mm_features, mm_inputs, strict=True)
        ]
        sampling = request.sampling_params
        n = 1 if sampling is None else sampling.n
        children: list[Request] = []
        try:
            for index in range(n):
                child = msgspec.structs.replace(request, mm_features=features)
                if n > 1 and sampling is not None:
                    seed = None if sampling.seed is None else sampling.seed + index
                    child.request_id = f"{request.request_id}{_CHILD}{index}"
                    child.sampling_params = msgspec.structs.replace(sampling, n=1, seed=seed)
                children.append(Request.from_core_request(child, eos_token_id=self.eos_token_id))
        except MMISError as exc:  # e.g. overlapping placeholder ranges
            self._immediate.append(_error(request.request_id, ErrorCode(exc.code), str(exc)))
            return
        for child_request in children:
            self.scheduler.add_request(child_request)
            if self.spans is not None:
                self.spans.admit(child_request.request_id, request.trace_context)
        if n > 1:
            self._children[request.request_id] = [c.request_id for c in children]

    def abort_requests(self, request_ids: list[str]) -> None:
        ids: list[str] = []
        for rid in request_ids:
            ids.extend(self._children.pop(rid, [rid]))
        self.scheduler.abort_requests(ids)
        if self.spans is not None:
            self.spans.forget(ids)

    def has_work(self) -> bool:
        return bool(self._immediate) or self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[EngineCoreOutput]:
        outputs, self._immediate = self._immediate, []
        if not self.scheduler.has_unfinished_requests() and not self.scheduler.has_pending_events():
            return outputs
        sched_out = self.scheduler.schedule()
        started_ns = time.time_ns()
        sampled: dict[str, list[int]] = {}
        pooled: dict[str, Any] = {}
        if not sched_out.is_empty:
            try:
                result = self.runner.execute(to_step_batch(sched_out))
            except Exception as exc:  # one bad step fails its requests, never the engine
                outputs.extend(self._fail_step(sched_out, exc))
            else:
                sampled = {rid: [tok] for rid, tok in result.sampled_token_ids.items()}
                pooled = result.pooled
            self.num_steps += 1
        events = self.scheduler.update_from_output(sched_out, sampled)
        for event in events:
            self._apply_stop_strings(event)
            out = event.to_wire()
            if event.request_id in pooled and event.finished:
                out.pooled = np.asarray(pooled[event.request_id], dtype=np.float32)
            outputs.append(self._to_parent(out))
        if self.spans is not None:
            self.spans.on_step(sched_out.scheduled, events, started_ns, time.time_ns())
        return outputs

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """Finish every request of a step the runner could not execute with an error output
        (one per parent for ``n > 1``, whose siblings are aborted), and forget encoder
        entries the runner never stored, so a later request recomputes them."""
        log.exception("step failed; failing its %d request(s)", len(sched_out.scheduled))
        code = ErrorCode(exc.code) if isinstance(exc, MMISError) else ErrorCode.INTERNAL
        message = f"the engine could not run this request: {exc}"
        outputs: list[EngineCoreOutput] = []
        hashes: set[str] = set()
        for item in sched_out.scheduled:
            hashes.update(item.mm_features[i].mm_hash for i in item.encoder_inputs)
            parent, _, _ = item.request_id.rpartition(_CHILD)
            if parent and parent in self._children:
                self.scheduler.abort_requests(self._children.pop(parent))
                outputs.append(_error(parent, code, message))
            elif self.scheduler.finish_request(item.request_id, FinishReason.ERROR):
                outputs.append(_error(item.request_id, code, message))
        encoder_cache = self.scheduler.encoder_cache
        for mm_hash in hashes:
            if mm_hash in encoder_cache and mm_hash not in self.runner.encoder_outputs:
                encoder_cache.cancel("", mm_hash)  # unreferenced now: just drop the entry
        return outputs

    def _apply_stop_strings(self, event: RequestEvent) -> None:
        request = self.scheduler.requests.get(event.request_id)
        if event.finished or request is None or self.tokenizer is None:
            return
        params = request.sampling_params
        if params is None or not params.stop or not event.new_token_ids:
            return
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        for stop in params.stop:
            if stop and stop in text:
                self.scheduler.finish_request(event.request_id, FinishReason.STOP, stop_reason=stop)
                event.finish_reason = FinishReason.STOP
                event.stop_reason = stop
                return

    def _to_parent(self, out: EngineCoreOutput) -> EngineCoreOutput:
        if _CHILD not in out.request_id:
            return out
        parent, _, index = out.request_id.rpartition(_CHILD)
        if parent not in self._children:
            return out
        out.request_id, out.index = parent, int(index)
        if out.finish_reason is not None:
            live = self._children.get(parent, [])
            child = f"{parent}{_CHILD}{index}"
            if child in live:
                live.remove(child)
            if not live:
                self._children.pop(parent, None)
        return out

    # ------------------------------------------------------------------ utilities
    def call_utility(self, method: str, args: list[Any]) -> Any:
        if method == "stats":
            return self.stats()
        if method == "reset_prefix_cache":
            return self.scheduler.kv.reset_prefix_cache()
        raise ValueError(f"unknown utility method {method!r}")

    def stats(self) -> dict[str, Any]:
        """``EngineStats(...).to_dict()`` (what P0's /metrics renders) plus engine details."""
        s = self.scheduler.stats()
        figures = EngineStats(
            num_requests_waiting=s.num_waiting,
            num_requests_running=s.num_running,
            kv_cache_usage=min(max(float(s.kv_usage), 0.0), 1.0),
            encoder_cache_evictions=self.scheduler.encoder_cache.num_evictions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
        ).to_dict()
        return figures | {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_usage,
            "num_kv_blocks": self.scheduler.kv.num_usable_blocks,
            "num_free_kv_blocks": self.scheduler.kv.num_free_blocks,
            "kv_block_bytes": int(self.runner.pool.spec.bytes_per_block),
            "encoder_cache_usage": s.encoder_cache_usage,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "num_rejected": s.num_rejected,
            "num_steps": self.num_steps,
            "encoder_calls": self.runner.num_encoder_calls,
        }
