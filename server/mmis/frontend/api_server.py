"""The FastAPI application of P0: OpenAI routes, probes, metrics, API-key check.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``GET /v1/models``, ``GET /health`` (process up and engine answering pings),
``GET /ready`` (a synthetic image request completed since start), ``GET /metrics`` (the
process' one metrics registry: P0's series, P1's polled figures, the drift gauge and P0's
level gauges; P1 is polled first when its snapshot is stale) and ``GET /stats/cache``.

``GET /stats/cache`` (unauthenticated, like the probes: the operator reads it on every ready
pod) answers the drift window as JSON: ``drift_rate`` (drift misses / shadow hits over the
window; 0.0 without shadow hits), ``hit_rate`` (sender-cache hits / lookups), ``retry_rate``
(retries / requests), the raw window deltas ``shadow_hits``, ``drift_misses``, ``queries``,
``retries``, ``requests``, and ``window_seconds`` / ``span_seconds`` (the configured window,
and how much of it the samples cover so far).

Invariants:
- Every error leaves in the OpenAI shape (:mod:`mmis.frontend.errors`), including
  401 for a missing or wrong API key (``code: invalid_api_key``) and unexpected exceptions
  (500, text not leaked).
- With an API key configured, every ``/v1/*`` route needs ``Authorization: Bearer <key>``;
  the probes, ``/metrics`` and ``/stats/cache`` stay open (kubelet, Prometheus and the
  operator carry no key).
- Each inference request is wrapped by :class:`RequestTelemetryMiddleware` (its server span,
  latency / TTFT / TPOT histograms, request and token counters).
- The app owns its :class:`FrontendState` through the lifespan: created on startup (engine
  handshake included), closed on shutdown after uvicorn drained in-flight requests.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import INVALID_REQUEST_TYPE, error_body
from mmis.frontend.request_telemetry import RequestTelemetryMiddleware
from mmis.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    install_exception_handlers,
    parse_request,
)
from mmis.frontend.serving_chat import ChatServing
from mmis.frontend.serving_common import ClientGoneError
from mmis.frontend.serving_completions import CompletionServing
from mmis.frontend.serving_embeddings import EmbeddingServing
from mmis.frontend.state import FrontendState
from mmis.telemetry.tracing import Tracing

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499


def _unauthorized(message: str) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": INVALID_REQUEST_TYPE,
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def create_app(
    settings: FrontendConfig,
    *,
    on_state: Callable[[FrontendState], None] | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The P0 app; ``on_state`` sees the state once it exists (tests, embedding servers);
    ``tracing`` replaces the one built from the settings (tests: an in-memory exporter)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await FrontendState.create(settings, tracing)
        app.state.mmis = state
        app.state.chat = ChatServing(state)
        app.state.completions = CompletionServing(state)
        app.state.embeddings = EmbeddingServing(state)
        if on_state is not None:
            on_state(state)
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="mmis", lifespan=lifespan)
    install_exception_handlers(app)

    async def on_gone(_: Request, __: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error", exc_info=exc)
        return JSONResponse(error_body(exc), status_code=500)

    app.add_exception_handler(ClientGoneError, on_gone)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_middleware(RequestTelemetryMiddleware, state_of=lambda: app.state.mmis)

    if settings.api_key:
        expected = f"Bearer {settings.api_key}".encode()

        @app.middleware("http")
        async def check_api_key(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "").encode()
                if not given:
                    return _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
                if not hmac.compare_digest(given, expected):
                    return _unauthorized("invalid API key")
            return await call_next(request)

    def state_of(request: Request) -> FrontendState:
        state: FrontendState = request.app.state.mmis
        return state

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await request.body(), max_n=settings.max_n)
        serving: ChatServing = request.app.state.chat
        return await serving.create(request, req)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await request.body(), max_n=settings.max_n)
        serving: CompletionServing = request.app.state.completions
        return await serving.create(request, req)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = parse_request(EmbeddingRequest, await request.body(), max_n=settings.max_n)
        serving: EmbeddingServing = request.app.state.embeddings
        return await serving.create(request, req)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state = state_of(request)
        card = ModelCard(
            id=state.model_name, root=settings.model, max_model_len=state.max_model_len
        )
        return ModelList(data=[card])

    @app.get("/health")
    async def health(request: Request) -> Response:
        state = state_of(request)
        if state.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not answering"}, status_code=503)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        state = state_of(request)
        if state.ready and state.healthy:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = state_of(request)
        await state.stats.refresh_if_stale()
        body, content_type = state.telemetry.metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/stats/cache")
    async def cache_stats(request: Request) -> Response:
        return JSONResponse(state_of(request).telemetry.drift.stats())

    return app
