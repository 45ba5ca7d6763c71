"""Text generation shared by ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``:
the API side of it.

The endpoint modules prepare a :class:`SourcePrompt` and supply a :class:`ResponseFormat`
(their response and chunk shapes); this module turns the OpenAI request into a
:class:`~mmis.frontend.client.output_processor.GenerateRequest` (data only), hands both to the
client's :class:`~mmis.frontend.client.output_processor.OutputProcessor` (which builds the
engine requests, retries, detokenizes, matches stop strings) and shapes what comes back:
whole, or as Server-Sent Events.

Invariants:
- Data flows one way (api -> client): what this module hands the client carries no callable,
  and nothing of the client calls back here (``tests/e2e/test_request_walk.py``,
  ``tests/frontend/test_output_processor.py``).
- A stream's HTTP status is decided only after every choice produced its first output
  (:meth:`OutputProcessor.stream`); after that, failures end the stream with the SSE error
  event (:func:`guard_stream`). Every exit path aborts the choices still running in P1.
- ``n``, seeds per choice and stop strings are the client's
  (``frontend/client/output_processor.py`` states those invariants).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from mmis.frontend.api.schemas import PromptTokensDetails, Usage, sse_chunk
from mmis.frontend.api.schemas.sampling import SamplingRequest
from mmis.frontend.api.serving_common import (
    SSEResponse,
    guard_stream,
    unless_disconnected,
)
from mmis.frontend.client.lora import LoRAAdapter, LoRANotFoundError
from mmis.frontend.client.output_processor import (
    FinishedChoice,
    GenerateRequest,
    OutputProcessor,
    OutputStream,
    TokenLogprob,
    TokenUsage,
)
from mmis.frontend.client.renderer import SourcePrompt
from mmis.frontend.errors import SSE_DONE, STALE_LORA_CODES
from mmis.protocol.errors import MMISError

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState

# one choice of a whole answer: its text, finish reason, and logprob rows (None: not asked)
Choice = FinishedChoice


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


def make_usage(tokens: TokenUsage) -> Usage:
    return Usage(
        prompt_tokens=tokens.prompt_tokens,
        completion_tokens=tokens.completion_tokens,
        total_tokens=tokens.prompt_tokens + tokens.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=tokens.cached_tokens),
    )


class TextGenerator:
    """One endpoint's generation: an OpenAI request in, its response (or SSE stream) out."""

    def __init__(self, state: FrontendState, endpoint: str) -> None:
        self.endpoint = endpoint
        self.outputs = OutputProcessor(state.policy, state.processor, state.max_model_len)
        self.lora = state.lora
        self.model_name_base = state.model_name
        self.base_names = frozenset(state.served_names)

    async def adapter(self, req: SamplingRequest) -> LoRAAdapter | None:
        """The LoRA adapter ``req.model`` names, as this P0 knows it now (``client/lora.py``;
        the engine is asked when it does not); None for the base model. A name the route
        resolved but that was unloaded since (through this P0 or a sibling, while the request's
        media loaded, or by a concurrent request's stale answer) is the 404 of an unknown
        model: a request naming an adapter is never answered by the base model."""
        name = req.model
        if name is None or name in self.base_names:
            return None
        adapter = await self.lora.resolve(name)
        if adapter is None:
            raise LoRANotFoundError(
                f"the model {name!r} does not exist on this server", param="model"
            )
        return adapter

    def generate_request(
        self, req: SamplingRequest, request_id: str, adapter: LoRAAdapter | None
    ) -> GenerateRequest:
        """What the client is handed: plain data (the wire sampling parameters, the cap, the
        LoRA adapter :meth:`adapter` found for ``model``)."""
        requested = req.requested_max_tokens()
        params = req.to_sampling_params(1 if requested is None else requested)
        if adapter is None:
            return GenerateRequest(request_id, self.endpoint, params, requested)
        return GenerateRequest(
            request_id, self.endpoint, params, requested, adapter.name, adapter.lora_id
        )

    def model_name(self, req: SamplingRequest) -> str:
        """The ``model`` answers carry: the LoRA adapter the request named (as vLLM), else the
        served model's first name. (Read from the name alone: the route let only served names
        and adapters through, and an adapter unloaded since is a 404 before any answer.)"""
        name = req.model
        return self.model_name_base if name is None or name in self.base_names else name

    def _stale(self, request: GenerateRequest, exc: MMISError) -> bool:
        """Whether the engine refused ``request``'s adapter as not loaded, or as loaded under
        another id (its codes, never its message): a sibling P0 unloaded (or reloaded) it, and
        this P0's entry is stale."""
        return request.lora_name is not None and exc.code in STALE_LORA_CODES

    async def respond(
        self,
        http: Request,
        req: SamplingRequest,
        source: SourcePrompt,
        fmt: ResponseFormat,
        request_id: str,
    ) -> Response:
        """The answer; a request under an adapter this P0 knows stale (``_stale``) is sent
        once more as the engine lists the adapter now, or is the 404 of an unknown model."""
        for attempt in range(2):
            request = self.generate_request(req, request_id, await self.adapter(req))
            try:
                if not req.stream:
                    whole = self.outputs.complete(source, request)
                    done = await unless_disconnected(http, whole)
                    body = fmt.whole(request_id, done.choices, make_usage(done.usage))
                    return JSONResponse(body.model_dump(mode="json"))
                stream = await unless_disconnected(http, self.outputs.stream(source, request))
                break
            except MMISError as exc:
                if not self._stale(request, exc):
                    raise
                name = request.lora_name or ""
                self.lora.forget(name)
                if attempt:
                    raise LoRANotFoundError(
                        f"the model {name!r} does not exist on this server", param="model"
                    ) from None
        events = self._events(fmt, request_id, stream, req.include_usage)
        return SSEResponse(guard_stream(events))

    async def _events(
        self, fmt: ResponseFormat, request_id: str, stream: OutputStream, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        try:
            for event in fmt.stream_start(request_id):
                yield event
            async for d in stream.deltas():
                for event in fmt.stream_delta(
                    request_id, d.index, d.text, d.finish_reason, d.first, d.logprobs
                ):
                    yield event
        finally:
            await stream.aclose()
        for event in fmt.stream_end(request_id, make_usage(stream.usage), include_usage):
            yield event
