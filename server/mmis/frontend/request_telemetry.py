"""One OpenAI request's telemetry: its HTTP server span, latency/TTFT/TPOT and token counts.

:class:`RequestTelemetryMiddleware` (pure ASGI, so it sees a streamed body to its end) wraps
each ``POST`` to an inference route in a SERVER span named ``"{operation} {model}"`` with
the GenAI request attributes, and puts a :class:`RequestRecord` in a context variable. The
serving code reaches it through :func:`current_record` (tasks it spawns copy the context, so
they share the record): the recovery policy notes output arrivals (:meth:`RequestRecord.
on_output`), the endpoints note usage (:meth:`RequestRecord.usage`). When the response's last
byte is sent (or the handler failed) the middleware observes ``mmis_request_latency_seconds``,
``mmis_time_to_first_token_seconds``, ``mmis_time_per_output_token_seconds`` and counts the
request with its status class and tokens; the span gets ``http.response.status_code`` and
the ``gen_ai.usage.*`` attributes.

Invariants:
- Probes, ``/metrics`` and ``/stats/cache`` are not wrapped (no span, no request count).
- TTFT is measured from the request's arrival at P0 to the first output carrying tokens of
  any attempt that produced tokens; TPOT observes the gap between consecutive token-carrying
  outputs of one choice, divided by the tokens the later one carried.
- Outside a request (the readiness probe) :func:`current_record` is ``None``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmis.telemetry import genai
from mmis.telemetry.bundle import FrontendTelemetry
from mmis.telemetry.tracing import Tracing

ROUTES = {
    "/v1/chat/completions": genai.OP_CHAT,
    "/v1/completions": genai.OP_TEXT_COMPLETION,
    "/v1/embeddings": genai.OP_EMBEDDINGS,
    "/v1/responses": genai.OP_CHAT,
}
HTTP_STATUS = "http.response.status_code"


class TelemetryHost(Protocol):
    """What the middleware reads from the front end's state: no import of the state."""

    @property
    def model_name(self) -> str: ...
    @property
    def tracing(self) -> Tracing: ...
    @property
    def telemetry(self) -> FrontendTelemetry: ...


@dataclasses.dataclass
class RequestRecord:
    span: trace.Span
    started: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None
    gaps: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    _last: dict[int, float] = dataclasses.field(default_factory=dict)

    def on_output(self, choice: int, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        last = self._last.get(choice)
        if last is not None:
            self.gaps.append((now - last) / num_tokens)
        self._last[choice] = now

    def usage(self, prompt: int, output: int, cached: int = 0) -> None:
        self.prompt_tokens += prompt
        self.output_tokens += output
        self.cached_tokens += min(cached, prompt)


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "mmis_request_record", default=None
)


def current_record() -> RequestRecord | None:
    return _current.get()


class RequestTelemetryMiddleware:
    def __init__(self, app: ASGIApp, state_of: Callable[[], TelemetryHost]) -> None:
        self.app = app
        self.state_of = state_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        operation = ROUTES.get(path)
        if operation is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        state = self.state_of()
        model = state.model_name
        status = 500

        async def send_watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        attributes = {**genai.request_attributes(operation, model), "http.route": path}
        with state.tracing.span(
            genai.span_name(operation, model), kind=trace.SpanKind.SERVER, attributes=attributes
        ) as span:
            record = RequestRecord(span)
            token = _current.set(record)
            try:
                await self.app(scope, receive, send_watching)
            finally:
                _current.reset(token)
                self._finish(state, path, status, record)

    @staticmethod
    def _finish(state: TelemetryHost, path: str, status: int, record: RequestRecord) -> None:
        metrics = state.telemetry.metrics
        metrics.request_finished(
            path,
            status,
            time.monotonic() - record.started,
            record.prompt_tokens,
            record.output_tokens,
        )
        if record.first_token_at is not None:
            metrics.first_token(path, record.first_token_at - record.started)
        metrics.output_tokens(path, record.gaps)
        span = record.span
        span.set_attribute(HTTP_STATUS, status)
        span.set_attributes(
            genai.usage_attributes(record.prompt_tokens, record.output_tokens, record.cached_tokens)
        )
        if status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"HTTP {status}"))
