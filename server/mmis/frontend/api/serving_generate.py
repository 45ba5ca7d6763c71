"""Text generation shared by ``/v1/chat/completions`` and ``/v1/completions``.

The endpoint modules prepare a :class:`SourcePrompt` and supply a :class:`ResponseFormat`
(their response and chunk shapes); this module runs the recovery policy, detokenizes each
choice and answers whole or as Server-Sent Events.

Invariants:
- P0 is the only owner of ``n``: ``n`` choices are ``n`` sibling engine requests with
  ``n=1`` each (choice ``i`` gets seed ``(seed + i) mod 2**63`` when a seed is given; P1
  refuses ``n != 1``), so one choice can be stopped, aborted or retried on its own.
- A stream's HTTP status is decided only after every sibling produced its first output
  (:meth:`RecoveryPolicy.start`); after that, failures end the stream with the SSE error
  event. Every exit path aborts the siblings still running in P1.
- P0 is the only owner of stop strings (P1 applies stop token ids only): each choice's
  :class:`IncrementalDetokenizer` matches them as tokens arrive, in streams and in whole
  responses alike; the text stops right before the match, ``finish_reason`` is ``stop`` and
  the sibling is aborted in P1 at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from mmis.frontend.api.detokenizer import IncrementalDetokenizer
from mmis.frontend.api.logprobs import LogprobsBuilder, TokenLogprob
from mmis.frontend.api.schemas import PromptTokensDetails, Usage, sse_chunk
from mmis.frontend.api.schemas.sampling import SamplingRequest
from mmis.frontend.api.serving_common import (
    SSEResponse,
    guard_stream,
    unless_disconnected,
)
from mmis.frontend.client.recovery import ChoiceWatch, Generation, RequestBuilder, RetryableFailure
from mmis.frontend.client.renderer import RenderedPrompt, SourcePrompt
from mmis.frontend.errors import SSE_DONE
from mmis.frontend.request_telemetry import current_record
from mmis.protocol.messages import EngineCoreOutput, EngineCoreRequest

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState

SEED_MODULUS = 2**63


# one choice of a whole answer: its text, finish reason, and logprob rows (None: not asked)
Choice = tuple[str, str | None, list[TokenLogprob] | None]


class ResponseFormat(Protocol):
    """An endpoint's response shapes: the whole answer, and a stream as SSE bytes."""

    def whole(self, request_id: str, choices: Sequence[Choice], usage: Usage) -> BaseModel: ...

    def stream_start(self, request_id: str) -> list[bytes]: ...

    def stream_delta(
        self,
        request_id: str,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool,
        logprobs: list[TokenLogprob] | None,
    ) -> list[bytes]: ...

    def stream_end(self, request_id: str, usage: Usage, include_usage: bool) -> list[bytes]: ...


class ChunkStream:
    """Chat's and completions' stream: one chunk per delta, the usage chunk when asked, then
    ``data: [DONE]``. A format using it defines ``chunk`` and ``usage_chunk``."""

    def chunk(
        self,
        request_id: str,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool,
        rows: list[TokenLogprob] | None = None,
    ) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, request_id: str, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def stream_start(self, request_id: str) -> list[bytes]:
        return []

    def stream_delta(
        self,
        request_id: str,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool,
        logprobs: list[TokenLogprob] | None,
    ) -> list[bytes]:
        return [sse_chunk(self.chunk(request_id, index, text, finish, first, logprobs))]

    def stream_end(self, request_id: str, usage: Usage, include_usage: bool) -> list[bytes]:
        tail = [sse_chunk(self.usage_chunk(request_id, usage))] if include_usage else []
        return [*tail, SSE_DONE]


def note_usage(prompt: int, completion: int, cached: int) -> None:
    """Hand the request's token counts to its telemetry record (spans, token counters)."""
    record = current_record()
    if record is not None:
        record.usage(prompt, completion, cached)


def make_usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class TextGenerator:
    def __init__(self, state: FrontendState, endpoint: str) -> None:
        self.state = state
        self.endpoint = endpoint

    def _builder(self, req: SamplingRequest) -> tuple[int, RequestBuilder]:
        requested = req.requested_max_tokens()
        max_len = self.state.max_model_len

        def build(rid: str, rendered: RenderedPrompt, choice: int) -> EngineCoreRequest:
            room = max(max_len - rendered.num_tokens, 1)
            params = req.to_sampling_params(room if requested is None else requested)
            params.n = 1
            if params.seed is not None:
                params.seed = (params.seed + choice) % SEED_MODULUS
            return EngineCoreRequest(
                rid,
                rendered.token_ids,
                rendered.features[choice],
                sampling_params=params,
                arrival_time=time.time(),
            )

        return (1 if requested is None else requested), build

    async def respond(
        self,
        http: Request,
        req: SamplingRequest,
        source: SourcePrompt,
        fmt: ResponseFormat,
        request_id: str,
    ) -> Response:
        reserve, build = self._builder(req)
        policy, n, endpoint = self.state.policy, req.n, self.endpoint
        if not req.stream:
            watched: list[IncrementalDetokenizer] = []  # the latest attempt's, per choice

            def watch() -> ChoiceWatch:  # per attempt: a stop string ends the choice in P1
                watched[:] = [self._detokenizer(req) for _ in range(n)]
                detoks = list(watched)

                def ends(choice: int, out: EngineCoreOutput) -> bool:
                    detoks[choice].add(out.new_token_ids)
                    return detoks[choice].stopped

                return ends

            rendered, outputs = await unless_disconnected(
                http,
                policy.complete(
                    source,
                    endpoint=endpoint,
                    request_id=request_id,
                    n=n,
                    reserve=reserve,
                    build=build,
                    # without stop strings nothing can end a choice early: no watch, no decode
                    watch=watch if req.stop_list() else None,
                ),
            )
            return self._whole(req, fmt, request_id, rendered, outputs, watched)
        generation = await unless_disconnected(
            http,
            policy.start(
                source, endpoint=endpoint, request_id=request_id, n=n, reserve=reserve, build=build
            ),
        )
        return SSEResponse(guard_stream(self._events(req, fmt, request_id, generation)))

    def _detokenizer(self, req: SamplingRequest) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.state.processor.decode, req.stop_list())

    def _logprobs(self) -> LogprobsBuilder:
        return LogprobsBuilder(self.state.processor.token_text)

    def _whole(
        self,
        req: SamplingRequest,
        fmt: ResponseFormat,
        request_id: str,
        rendered: RenderedPrompt,
        outputs: list[list[EngineCoreOutput]],
        watched: Sequence[IncrementalDetokenizer],
    ) -> Response:
        """The whole response. ``watched``: the detokenizers that matched stop strings while
        the outputs arrived (empty without stop strings); each is finished, not redone, so a
        choice is decoded once and counts the tokens a stream of it would: up to the output
        that completed its stop string."""
        choices: list[Choice] = []
        completion = cached = 0
        wants_logprobs = req.logprobs_count() is not None
        for index, outs in enumerate(outputs):
            detok = watched[index] if watched else self._detokenizer(req)
            if not detok.stopped:  # what the watch has not seen: all, or the final output
                token_ids = [t for out in outs for t in out.new_token_ids]
                detok.add(token_ids[len(detok.token_ids) :], final=True)
            completion += len(detok.token_ids)
            cached = max([cached, *(out.num_cached_tokens for out in outs)])
            finish = "stop" if detok.stopped else (outs[-1].finish_reason if outs else None)
            rows = None
            if wants_logprobs:
                builder = self._logprobs()
                for out in outs:
                    builder.add(out)
                rows = builder.kept(len(detok.token_ids))
            choices.append((detok.text, finish, rows))
        usage = make_usage(rendered.num_tokens, completion, cached)
        note_usage(rendered.num_tokens, completion, cached)
        body = fmt.whole(request_id, choices, usage)
        return JSONResponse(body.model_dump(mode="json"))

    async def _events(
        self, req: SamplingRequest, fmt: ResponseFormat, request_id: str, gen: Generation
    ) -> AsyncGenerator[bytes, None]:
        detoks = [self._detokenizer(req) for _ in range(gen.n)]
        builders = [self._logprobs() for _ in range(gen.n)]
        wants_logprobs = req.logprobs_count() is not None
        started = [False] * gen.n
        cached = 0
        for event in fmt.stream_start(request_id):
            yield event
        try:
            async for choice, out in gen.outputs():
                detok = detoks[choice]
                final = out.finish_reason is not None
                kept_before = len(detok.token_ids)
                delta = detok.add(out.new_token_ids, final=final)
                cached = max(cached, out.num_cached_tokens)
                finish = out.finish_reason if final else None
                if detok.stopped:
                    finish = "stop"
                    await gen.finish_choice(choice)
                rows = None
                if wants_logprobs:  # the rows of the tokens this output added and the text keeps
                    builders[choice].add(out)
                    rows = builders[choice].delta(kept_before, len(detok.token_ids))
                if delta or finish or rows or not started[choice]:
                    first = not started[choice]
                    for event in fmt.stream_delta(request_id, choice, delta, finish, first, rows):
                        yield event
                    started[choice] = True
        except RetryableFailure as failure:
            raise failure.error() from None
        finally:
            await gen.aclose()
        rendered = gen.rendered
        prompt = rendered.num_tokens if rendered is not None else 0
        completion = sum(len(d.token_ids) for d in detoks)
        note_usage(prompt, completion, cached)
        usage = make_usage(prompt, completion, cached)
        for event in fmt.stream_end(request_id, usage, req.include_usage):
            yield event
