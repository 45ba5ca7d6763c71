"""The engine core: scheduler + model runner, one step at a time.

Invariants:
- Only the busy-loop thread calls into this object (see ``core_process.py``).
- A request that cannot run (bad token ids, too long for the context, bad parameters,
  ``logit_bias`` token ids outside the vocabulary, ``n != 1``, item tensors that do not match
  their placeholder; see ``admission.py``) is answered with a ``finish_reason="error"`` output
  at admission and never reaches the scheduler. P0 owns the ``n`` choices: it sends one
  request per choice.
- Safety net: if the runner still fails a step, that step's requests end with an error output,
  encoder entries it never stored are dropped, and the engine keeps serving; :meth:`step`
  never raises for anything a client sent.
- Stop *token ids* (EOS, ``stop_token_ids``) end a request here (``Request.check_stop``); stop
  *strings* are P0's (its detokenizer matches them and aborts the request), so the core needs
  no tokenizer.
- The runner reads the scheduler's requests (their token lists) for penalties; only the
  scheduler changes them, between steps.
- Structured outputs (``engine/execution/structured.py``): a request whose params carry
``structured``
  gets its own params copy and a fresh grammar state at admission (the grammar compiled
  once per distinct constraint, cached); a constraint that does not compile, or an engine
  without a grammar engine, is an ``invalid_request`` output naming the request parameter
  that carried it (``RequestError.param``). The runner's sampler masks with the same
  grammar engine; after each step's update the core hands the step's tokens to the grammar
  engine's accept worker (``GrammarEngine.flush``), which accepts them during the next
  forward.
- Prompt logprobs (``SamplingParams.prompt_logprobs``): the runner's rows of each prefill
  chunk are kept per request, by prompt position (a chunk computed again after a preemption
  overwrites its rows), and sent whole in the request's first output with tokens; dropped
  when the request ends. Such requests bypass the prefix cache (``Request.skip_cache``).
- :meth:`utilities` is the core's part of the one utility table (``core_process.py``).
- Async scheduling (``async_scheduling``; ``--async-scheduling``, on by default on CUDA): at
  most one step is in flight between two :meth:`step` calls. A call schedules step N+1 while
  step N runs on the device, launches it (queued behind N), then collects N (waits for its
  sampled ids' copy) and runs N's update; its outputs are N's. In N+1 a decode row whose
  previous token is N's holds a placeholder (the scheduler counts it as a computed token,
  ``scheduler.py``), read by the runner from N's sampled ids on the device; N's update turns
  it into the token, so outputs, stop checks and prefix-cache keys only ever see real tokens.
  A request N's update finishes (EOS, stop ids; ``max_tokens`` and ``max_model_len`` are seen
  ahead and get no row) has its N+1 row computed for nothing: its token is dropped, its
  blocks were freed by the finish; an abort between calls drops the step in flight's token
  too, as the synchronous loop never produced it before the abort. Every request's tokens are
  the synchronous loop's (greedy and seeded sampling: ``tests/engine/test_async_scheduling.py``).
  The synchronous step is kept where overlap would not be exact: a step whose sampled rows
  include a request that is not ``Request.overlappable`` (penalties read the token history,
  a grammar mask needs the accepted token, prompt logprobs) is updated before the next pass;
  under tensor parallelism every step is. Preemption is exact either way (a request preempted
  while its token is in flight still gets it, ``scheduler.py``). A failed launch first
  finishes the step in flight, then fails its own requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np

from mmis.engine.execution.runner import LaunchedStep, ModelRunner
from mmis.engine.lora.errors import LoRADisabledError, LoRAInUseError
from mmis.engine.scheduling.admission import ModelLimits, Problem, check_request
from mmis.engine.scheduling.request import Request
from mmis.engine.scheduling.sched_output import SchedulerOutput, StepOutput
from mmis.engine.scheduling.scheduler import Scheduler
from mmis.protocol.encoder import MM_EMBEDS
from mmis.protocol.errors import MMISError
from mmis.protocol.kv_events import RESET_PREFIX_CACHE
from mmis.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
    SamplingParams,
    TokenLogprobs,
)
from mmis.telemetry.engine_stats import EngineStats

if TYPE_CHECKING:
    from mmis.engine.execution.structured import GrammarEngine, GrammarState
    from mmis.engine.kv_events import KVEventStream
    from mmis.telemetry.request_spans import RequestSpans

log = logging.getLogger(__name__)

__all__ = ["EngineCore"]


_NOTHING = StepOutput()  # a step that sampled nothing (empty or failed); never changed


def _error(
    request_id: str, code: ErrorCode, message: str, param: str | None = None
) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request_id,
        finish_reason=FinishReason.ERROR.value,
        error=RequestError(code=code.value, message=message, retryable=False, param=param),
    )


class _InFlight(NamedTuple):
    """The step launched and not yet collected (async scheduling)."""

    sched_out: SchedulerOutput
    launched: LaunchedStep
    started_ns: int


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        *,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
        spans: RequestSpans | None = None,
        grammar: GrammarEngine | None = None,
        kv_events: KVEventStream | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.spans = spans  # P1 tracing (None when off): see telemetry.request_spans
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = tuple(eos_token_ids)  # all of them stop (generation_config's list)
        self.max_model_len = max_model_len
        self.vocab_size = int(runner.adapter.vocab_size)
        self.limits = ModelLimits(self.vocab_size, max_model_len)
        self._immediate: list[EngineCoreOutput] = []
        # prompt logprobs waiting for the first output: request id -> position -> row
        self._prompt_rows: dict[str, dict[int, tuple[list[int], list[float], int]]] = {}
        self.num_steps = 0
        self.grammar = grammar  # structured outputs; None: such requests are refused
        runner.sampler.grammar = grammar
        # prefix-cache events for routers (engine/kv_events.py); None: not announced
        self.kv_events = kv_events
        if kv_events is not None:
            scheduler.kv.pool.events = kv_events.log
        # schedule step N+1 while step N runs (see the module docstring)
        self.async_scheduling = scheduler.async_scheduling = async_scheduling
        log.info("async scheduling: %s", "on" if async_scheduling else "off")
        self._in_flight: _InFlight | None = None

    # ------------------------------------------------------------------ intake
    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit ``request`` (or answer it with an error output); never raises for bad input.

        Its items' ``data`` hold their resolved tensors (``engine/core_process.py``)."""
        problem = check_request(request, self.limits, self.runner.adapter)
        if problem is None and request.request_id in self.scheduler.requests:
            problem = Problem(
                ErrorCode.INVALID_REQUEST, f"request id {request.request_id!r} is in use"
            )
        if problem is not None:
            self._immediate.append(_error(request.request_id, problem.code, problem.message))
            return
        constraint = None
        if request.sampling_params is not None and request.sampling_params.structured is not None:
            own = msgspec.structs.replace(request.sampling_params)  # the grammar state's key
            request = msgspec.structs.replace(request, sampling_params=own)
            try:
                constraint = self._start_constraint(own)
            except MMISError as exc:
                param = getattr(exc, "param", None)
                self._immediate.append(
                    _error(request.request_id, ErrorCode(exc.code), str(exc), param)
                )
                return
        lora = self.runner.lora
        if request.lora_name is not None:  # engine/lora/: a registered adapter under its id
            pre_encoded = any(  # by a remote encoder (E/PD): the base tower's output
                isinstance(f.data, Mapping) and MM_EMBEDS in f.data for f in request.mm_features
            )
            why = (  # typed: its code goes on the wire (P0 looks a lora_not_loaded up again)
                LoRADisabledError(
                    f"LoRA adapter {request.lora_name!r} cannot be served: "
                    "this engine runs without --enable-lora"
                )
                if lora is None
                else lora.refusal(request.lora_name, request.lora_id, pre_encoded=pre_encoded)
            )
            if why is not None:
                self._immediate.append(_error(request.request_id, ErrorCode(why.code), str(why)))
                return
        try:
            admitted = Request.from_core_request(
                request,
                eos_token_ids=self.eos_token_ids,
                constraint=constraint,
                lora_tower=lora is not None and lora.changes_tower(request.lora_name),
            )
        except MMISError as exc:  # e.g. overlapping placeholder ranges
            self._immediate.append(_error(request.request_id, ErrorCode(exc.code), str(exc)))
            return
        self.scheduler.add_request(admitted)
        if self.spans is not None:
            self.spans.admit(request.request_id, request.trace_context)

    def _start_constraint(self, params: SamplingParams) -> GrammarState:
        from mmis.engine.execution.structured import StructuredOutputError

        param = params.structured.param if params.structured is not None else None
        if self.grammar is None:
            raise StructuredOutputError(
                f"{param or 'structured outputs'}: this engine has no grammar engine (it "
                "could not load the model's tokenizer)",
                param,
            )
        return self.grammar.start(params)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        for request_id in request_ids:
            self._prompt_rows.pop(request_id, None)
        if self.spans is not None:
            self.spans.forget(request_ids)

    def has_work(self) -> bool:
        return (
            bool(self._immediate)
            or self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
        )

    # ------------------------------------------------------------------ one step
    def step(self) -> list[EngineCoreOutput]:
        outputs, self._immediate = self._immediate, []
        if self.async_scheduling:
            return self._step_ahead(outputs)
        scheduler = self.scheduler
        if not scheduler.has_unfinished_requests() and not scheduler.has_pending_outputs():
            return outputs
        sched_out = self.scheduler.schedule()
        started_ns = time.time_ns()
        result = _NOTHING
        if not sched_out.is_empty:
            try:
                result = self.runner.execute(sched_out, self.scheduler.requests)
            except Exception as exc:  # one bad step fails its requests, never the engine
                outputs.extend(self._fail_step(sched_out, exc))
            else:
                self._keep_prompt_rows(result.prompt_logprobs)
            self.num_steps += 1
        outputs.extend(self._update(sched_out, result, started_ns))
        return outputs

    def _step_ahead(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """One call of the async loop: schedule and launch step N+1, then collect and update
        step N (the one in flight); ``outputs`` so far, plus N's."""
        scheduler = self.scheduler
        flight = self._in_flight
        if flight is not None and (
            flight.sched_out.needs_update_first or self.runner.tensor_parallel is not None
        ):  # the next pass needs this step's tokens on the host
            outputs.extend(self._land())
            flight = None
        if not scheduler.has_unfinished_requests() and not scheduler.has_pending_outputs():
            if flight is not None:
                outputs.extend(self._land())
            return outputs
        sched_out = scheduler.schedule()
        if sched_out.is_empty:  # nothing to overlap: finish N, then deliver the pass's outputs
            if flight is not None:
                outputs.extend(self._land())
            outputs.extend(self._update(sched_out, _NOTHING, time.time_ns()))
            return outputs
        started_ns = time.time_ns()
        try:
            launched = self.runner.launch(sched_out, scheduler.requests)
        except Exception as exc:  # N's tokens first, as the synchronous loop had them
            if flight is not None:
                outputs.extend(self._land())
            outputs.extend(self._fail_step(sched_out, exc))
            self.num_steps += 1
            outputs.extend(self._update(sched_out, _NOTHING, started_ns))
            return outputs
        self.num_steps += 1
        if flight is not None:
            outputs.extend(self._land())
        self._in_flight = _InFlight(sched_out, launched, started_ns)
        return outputs

    def _land(self) -> list[EngineCoreOutput]:
        """Collect the step in flight (if any) and run its update; its outputs."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        try:
            result = self.runner.collect(flight.launched)
        except Exception as exc:  # as a failed step of the synchronous loop
            failed = self._fail_step(flight.sched_out, exc)
            return failed + self._update(flight.sched_out, _NOTHING, flight.started_ns)
        self._keep_prompt_rows(result.prompt_logprobs)
        return self._update(flight.sched_out, result, flight.started_ns)

    def _update(
        self, sched_out: SchedulerOutput, result: StepOutput, started_ns: int
    ) -> list[EngineCoreOutput]:
        """The scheduler's update for a step that ran (``result``; ``_NOTHING`` for an
        empty or failed step) and the wire outputs it gives."""
        sampled, pooled, logprobs = result.sampled, result.pooled, result.logprobs
        produced = self.scheduler.update_from_output(sched_out, sampled)
        if self.kv_events is not None:
            self.kv_events.flush()
        if self.grammar is not None:  # the step's grammar accepts run during the next forward
            self.grammar.flush()
        prompt_rows = self._prompt_rows
        if pooled or logprobs or prompt_rows:
            for out in produced:
                rid = out.request_id
                if pooled and rid in pooled and out.finish_reason is not None:
                    out.pooled = np.asarray(pooled[rid], dtype=np.float32)
                if logprobs and out.new_token_ids and rid in logprobs:
                    out.logprobs = logprobs[rid]
                if (
                    prompt_rows
                    and rid in prompt_rows
                    and (out.new_token_ids or out.finish_reason is not None)
                ):
                    out.prompt_logprobs = self._take_prompt_rows(rid, out.new_token_ids)
        if self.spans is not None:
            self.spans.on_step(sched_out.scheduled, produced, started_ns, time.time_ns())
        return produced

    def _keep_prompt_rows(self, chunks: Mapping[str, tuple[int, TokenLogprobs]]) -> None:
        for request_id, (start, lp) in chunks.items():
            rows = self._prompt_rows.setdefault(request_id, {})
            for i, row in enumerate(zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True)):
                rows[start + i] = row

    def _take_prompt_rows(self, request_id: str, new_token_ids: list[int]) -> TokenLogprobs | None:
        """The request's prompt logprobs, in prompt order (``None`` for an output without
        tokens: an error or abort before the first token drops them)."""
        rows = self._prompt_rows.pop(request_id)
        if not new_token_ids:
            return None
        out = TokenLogprobs()
        for position in sorted(rows):
            ids, values, rank = rows[position]
            out.token_ids.append(ids)
            out.logprobs.append(values)
            out.ranks.append(rank)
        return out

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """Finish every request of a step the runner could not execute with an error output,
        and forget encoder entries the runner never stored, so a later request recomputes
        them."""
        log.exception("step failed; failing its %d request(s)", len(sched_out.scheduled))
        code = ErrorCode(exc.code) if isinstance(exc, MMISError) else ErrorCode.INTERNAL
        message = f"the engine could not run this request: {exc}"
        outputs: list[EngineCoreOutput] = []
        hashes: set[str] = set()
        for item in sched_out.scheduled:
            hashes.update(item.mm_items[i].mm_hash for i in item.encoder_inputs)
            self._prompt_rows.pop(item.request_id, None)
            if self.scheduler.finish_request(item.request_id, FinishReason.ERROR):
                outputs.append(_error(item.request_id, code, message))
        encoder_cache = self.scheduler.encoder_cache
        for mm_hash in hashes:
            if mm_hash in encoder_cache and mm_hash not in self.runner.encoder_outputs:
                encoder_cache.cancel("", mm_hash)  # unreferenced now: just drop the entry
        return outputs

    # ------------------------------------------------------------------ utilities
    def utilities(self) -> Mapping[str, Callable[..., Any]]:
        """The utility calls the busy loop runs on this core, by name."""
        table: dict[str, Callable[..., Any]] = {
            "stats": self.stats,
            RESET_PREFIX_CACHE: self.reset_prefix_cache,
        }
        lora = self.runner.lora
        if lora is not None:  # engine/lora/ (issue 47): P0's load/unload API calls these
            table |= {
                "load_lora_adapter": lora.load_call,
                "unload_lora_adapter": self.unload_lora_adapter,
                "list_lora_adapters": lora.list_call,
            }
        return table

    def unload_lora_adapter(self, name: str) -> bool:
        """Unregister LoRA adapter ``name`` (engine/lora/), refused while a live request runs
        under it (its next step would find no weights)."""
        lora = self.runner.lora
        if lora is None:
            raise LoRADisabledError("this engine runs without --enable-lora")
        live = sum(r.lora_name == name for r in self.scheduler.requests.values())
        if live:
            raise LoRAInUseError(f"LoRA adapter {name!r} is in use by {live} request(s)")
        return lora.unload_call(name)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (announced at once); returns how many."""
        count = self.scheduler.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return count

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
        return (
            figures
            | {
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
            | (self.grammar.stats() if self.grammar is not None else {})
        )
