"""The FastAPI application of P0: OpenAI routes, probes, metrics, the HTTP gate.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
``POST /v1/embeddings``,
``GET /v1/models`` (every served name, then each LoRA adapter with its ``parent``),
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (with
``--allow-runtime-lora-updating``: :mod:`mmis.frontend.api.lora_routes`), ``GET /version``,
``GET /health`` (this process answers: the front-end container's liveness, whatever the
engine does), ``GET /ready`` (a synthetic image request completed since start, and the
engine link up: readiness),
and the operations routes ``GET /metrics`` (the process' one metrics registry: P0's series,
P1's polled figures, the drift gauge and P0's level gauges; P1 is polled first when its
snapshot is stale; one of N processes, ``--api-servers``, answers for all N there:
:mod:`mmis.frontend.api.api_server_group`), ``GET /stats/cache``,
``POST /internal/block_keys`` (a chat request's prefix-cache block keys, for routers:
docs/ROUTING.md), ``POST /internal/reset_prefix_cache``
(P1 forgets its cached prefix blocks and announces it; answers how many) and
``POST /internal/load_lora_adapter`` / ``/internal/unload_lora_adapter`` (the operator's
idempotent adapter sync: :mod:`mmis.frontend.api.lora_routes`) — on ``--ops-port``
when it is set. The ``/internal/*`` routes answer only the internal token
(``MMIS_FRONTEND_INTERNAL_TOKEN``; 403 without one configured), never the API key.

``GET /stats/cache`` (no key: the operator reads it on every ready pod) answers the drift
window as JSON: ``drift_rate`` (drift misses / shadow hits over the window; 0.0 without
shadow hits), ``hit_rate`` (sender-cache hits / lookups), ``retry_rate`` (retries /
requests), the raw window deltas ``shadow_hits``, ``drift_misses``, ``queries``,
``retries``, ``requests``, and ``window_seconds`` / ``span_seconds`` (the configured window,
and how much of it the samples cover so far); with LoRA on (the engine's ``--enable-lora``),
``lora``: ``{"adapters": [{"name", "path"}, ...] sorted by name, "max_loras"}``, the engine's
list asked on each call as ``/v1/models`` does (the same for every ``--api-servers``
process), for the operator's adapter sync; without LoRA the key is absent.

Invariants:
- Every request passes :class:`~mmis.frontend.api.http_gate.HttpGate` first (the outermost
  middleware): operations routes on their port, the internal token on ``/internal/*``, the
  API key on every other route of the serving port but ``/health`` and ``/ready``, JSON
  bodies only (415), bounded bodies (413). The gate names the request's tenant
  (:func:`~mmis.frontend.api.http_gate.tenant_of`), which every route that takes images
  hands to the renderer: a uuid names an image for its tenant only.
- ``/internal/block_keys`` binds no uuid; a uuid-only item the request's tenant has no
  binding for is left out of ``mm_hashes``, and the keys stop where it starts (the tenant is
  the ``--tenant-header`` value, or without API keys the anonymous one; with keys and no
  tenant header, no uuid-only item is resolved there).
- Every error leaves in the OpenAI shape (:mod:`mmis.frontend.errors`): malformed JSON
  (deep nesting included) is 400, unknown paths 404, a model the server does not serve 404
  ``model_not_found`` (a generation route's ``model`` may also name a LoRA adapter the
  engine holds, asked of the engine before the 404: ``client/lora.py``), unexpected
  exceptions 500 (text not leaked).
- A chat or completion request's unset sampling fields take the model's generation-config
  values (:mod:`mmis.frontend.api.generation_defaults`, ``--generation-config``).
- A body is parsed on a worker thread when it is large (:data:`INLINE_PARSE_BYTES`), so
  no request stalls the event loop that answers ``/health`` and streams.
- Each inference request is wrapped by :class:`RequestTelemetryMiddleware` (its server span,
  latency / TTFT / TPOT histograms, request and token counters).
- The app owns its :class:`FrontendState` through the lifespan: created on startup (engine
  handshake included), closed on shutdown after the drain (:mod:`mmis.frontend.api.drain`:
  after SIGTERM new work gets a retryable 503, in-flight work ends by the deadline, cleanly)
  and uvicorn's own; ``/ready`` is 503 ``draining`` from the signal on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from mmis.frontend.access_log import quiet_access_log
from mmis.frontend.api import generation_defaults
from mmis.frontend.api.api_server_group import ApiServerGroup, group_cache_stats, group_metrics
from mmis.frontend.api.drain import Drain, DrainMiddleware
from mmis.frontend.api.http_gate import HttpGate, MiB, tenant_of
from mmis.frontend.api.lora_routes import install_lora_routes
from mmis.frontend.api.openapi import install_openapi
from mmis.frontend.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    install_exception_handlers,
    parse_request,
)
from mmis.frontend.api.schemas.responses import LoRAAdapterStat, LoRAStats
from mmis.frontend.api.schemas.responses_api import ResponsesRequest
from mmis.frontend.api.schemas.sampling import SamplingRequest
from mmis.frontend.api.serving_chat import ChatServing
from mmis.frontend.api.serving_common import ClientGoneError
from mmis.frontend.api.serving_completions import CompletionServing
from mmis.frontend.api.serving_embeddings import EmbeddingServing
from mmis.frontend.api.serving_responses import ResponsesServing
from mmis.frontend.client.lora import LoRAAdapter
from mmis.frontend.client.sibling_bindings import SiblingBindings
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import (
    FrontendError,
    InvalidRequestError,
    ModelNotFoundError,
    error_body,
    json_response,
)
from mmis.frontend.request_telemetry import RequestTelemetryMiddleware
from mmis.frontend.state import FrontendState
from mmis.protocol.kv_events import RESET_PREFIX_CACHE
from mmis.telemetry.tracing import Tracing

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
INLINE_PARSE_BYTES = 256 * 1024
M = TypeVar("M", bound=BaseModel)


def version() -> str:
    try:
        return metadata.version("mmis")
    except metadata.PackageNotFoundError:
        return "unknown"


def create_app(
    settings: FrontendConfig,
    *,
    on_state: Callable[[FrontendState], None] | None = None,
    tracing: Tracing | None = None,
    engine_failed: Callable[[], str | None] | None = None,
    group: ApiServerGroup | None = None,
) -> FastAPI:
    """The P0 app; ``on_state`` sees the state once it exists (tests, embedding servers);
    ``tracing`` replaces the one built from the settings (tests: an in-memory exporter);
    ``engine_failed`` says why P1 will never answer (start-up then fails at once); ``group``:
    this process is one of N (``--api-servers``), its private socket and siblings there."""
    quiet_access_log()  # access lines for the API and failures only (access_log.py)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            state = await FrontendState.create(settings, tracing, engine_failed)
        except Exception as exc:  # the launcher ends its output with why (entrypoints/)
            app.state.startup_error = exc
            raise
        app.state.mmis = state
        if group is not None and group.count > 1:  # a uuid bound by a sibling resolves here
            state.renderer.siblings = SiblingBindings(
                [group.socket_path(i) for i in group.siblings]
            )
        app.state.generation_defaults = await asyncio.to_thread(
            generation_defaults.load, settings.model, settings.revision, settings.generation_config
        )
        app.state.chat = ChatServing(state)
        app.state.completions = CompletionServing(state)
        app.state.embeddings = EmbeddingServing(state)
        app.state.responses = ResponsesServing(state)
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

    async def on_http(_: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
        detail = exc.detail if isinstance(exc, HTTPException) else "error"
        return json_response(FrontendError(str(detail), code=code, status=status))

    app.add_exception_handler(ClientGoneError, on_gone)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
    drain = Drain(settings.graceful_shutdown_s)
    app.state.drain = drain  # begun by the server on SIGTERM (entrypoints/frontend.py)
    app.add_middleware(DrainMiddleware, drain=drain)  # inside the telemetry: it counts its 503s
    app.add_middleware(RequestTelemetryMiddleware, state_of=lambda: app.state.mmis)
    app.add_middleware(  # outermost: nothing runs for a request it refuses
        HttpGate,
        api_keys=settings.api_keys,
        max_body_bytes=int(settings.max_request_body_mb * MiB),
        ops_port=settings.ops_port,
        internal_token=settings.internal_token,
        tenant_header=settings.tenant_header,
        private_socket=None if group is None else group.socket_path(group.index),
    )
    served = settings.served_names

    def state_of(request: Request) -> FrontendState:
        state: FrontendState = request.app.state.mmis
        return state

    async def engine_adapters(state: FrontendState) -> list[LoRAAdapter]:
        """The LoRA adapters the engine holds: its list, which a sibling P0 may have changed
        (else, when the engine cannot answer, what this P0 knows); none without LoRA."""
        if state.lora.enabled:
            with contextlib.suppress(FrontendError, TimeoutError):
                await state.lora.refresh()
        return state.lora.adapters()

    async def parse(request: Request, model: type[M]) -> M:
        """The body as ``model`` (400 when malformed), naming a served model (else 404)."""
        body = await request.body()
        if len(body) > INLINE_PARSE_BYTES:
            req = await asyncio.to_thread(parse_request, model, body, max_n=settings.max_n)
        else:
            req = parse_request(model, body, max_n=settings.max_n)
        name = getattr(req, "model", None)
        if name is not None and name not in served:
            lora = state_of(request).lora  # a LoRA adapter's name (client/lora.py)
            if not isinstance(req, SamplingRequest):  # adapters generate text only
                raise ModelNotFoundError(name, served)
            if await lora.resolve(name) is None:
                raise ModelNotFoundError(name, [*served, *(a.name for a in lora.adapters())])
        if isinstance(req, SamplingRequest):  # the model's own defaults for what is unset
            req = generation_defaults.apply(req, request.app.state.generation_defaults)
        return req

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        serving: ChatServing = request.app.state.chat
        return await serving.create(request, req, tenant=tenant_of(request.scope))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        serving: CompletionServing = request.app.state.completions
        return await serving.create(request, req)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = await parse(request, ResponsesRequest)
        serving: ResponsesServing = request.app.state.responses
        return await serving.create(request, req, tenant=tenant_of(request.scope))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = await parse(request, EmbeddingRequest)
        serving: EmbeddingServing = request.app.state.embeddings
        return await serving.create(request, req, tenant=tenant_of(request.scope))

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state = state_of(request)
        engine = state.client.engine_info
        cards = [
            ModelCard(
                id=name,
                root=settings.model,
                max_model_len=state.max_model_len,
                dtype=engine.get("dtype"),
                device=engine.get("device"),
            )
            for name in served
        ]
        cards += [  # vLLM's shape: the adapter's path as root, the base model as parent
            ModelCard(
                id=adapter.name,
                created=adapter.created,
                root=adapter.path,
                parent=settings.model_name,
                max_model_len=state.max_model_len,
                dtype=engine.get("dtype"),
                device=engine.get("device"),
            )
            for adapter in await engine_adapters(state)
        ]
        return ModelList(data=cards)

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse({"version": version()})

    @app.get("/health")
    async def health() -> Response:  # the front end's liveness: this process only
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        state = state_of(request)
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.ready and state.healthy:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = state_of(request)
        await state.stats.refresh_if_stale()
        accept = request.headers.get("accept")
        own = state.telemetry.metrics
        if group is None:
            body, content_type = own.exposition(accept)
        elif group.is_private(request.scope):  # a sibling asks: this process's own figures
            body, content_type = own.exposition(accept, api_server=group.label)
        else:
            body, content_type = await group_metrics(group, own, accept)
        return Response(body, media_type=content_type)

    @app.get("/stats/cache")
    async def cache_stats(request: Request) -> Response:
        state = state_of(request)
        own = state.telemetry.drift.stats()
        if group is not None and group.is_private(request.scope):
            return JSONResponse(own)  # a sibling sums the windows (api_server_group.py)
        stats: dict[str, object] = dict(
            own if group is None else await group_cache_stats(group, own)
        )
        if state.lora.enabled:  # the operator's adapter sync reads what the engine holds
            adapters = sorted(await engine_adapters(state), key=lambda a: a.name)
            stats["lora"] = LoRAStats(  # the document's shape (schemas/responses.py)
                adapters=[LoRAAdapterStat(name=a.name, path=a.path) for a in adapters],
                max_loras=int(state.client.engine_info.get("max_loras", 0)),
            ).model_dump()
        return JSONResponse(stats)

    @app.post("/sibling/uuid_binding", include_in_schema=False)  # no port serves it
    async def sibling_uuid_binding(request: Request) -> Response:
        """A sibling P0 asks what a tenant's uuid is bound to here (private socket only:
        ``http_gate.SIBLING_PATHS``), and what this shadow knows of that content."""
        try:
            body = json.loads(await request.body())
            tenant, modality, uuid = body["tenant"], body["modality"], body["uuid"]
        except (ValueError, KeyError, TypeError):
            raise InvalidRequestError("expected {tenant, modality, uuid}") from None
        if not all(isinstance(v, str) for v in (tenant, modality, uuid)):
            raise InvalidRequestError("tenant, modality and uuid are strings")
        state = state_of(request)
        mm_hash = state.renderer.bindings.resolve(tenant, modality, uuid)
        entry = None if mm_hash is None else state.shadow.get(mm_hash)
        shown = None
        if entry is not None:
            shown = {"nbytes": entry.nbytes, "placeholder_length": entry.placeholder_length}
        return JSONResponse({"mm_hash": mm_hash, "entry": shown})

    @app.post("/internal/block_keys")
    async def block_keys(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        serving: ChatServing = request.app.state.chat
        return JSONResponse(await serving.block_keys(req, tenant=tenant_of(request.scope)))

    @app.post("/internal/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        blocks = await state_of(request).client.call_utility(RESET_PREFIX_CACHE)
        return JSONResponse({"blocks": int(blocks)})

    install_lora_routes(app, settings)
    install_openapi(app)
    return app
