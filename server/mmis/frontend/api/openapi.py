"""The OpenAPI document of P0 (``GET /openapi.json``): every route, its body, its answers.

The inference routes read their body themselves (``parse_request`` in
:mod:`mmis.frontend.api.schemas.validation`: our own JSON handling and 400s), so FastAPI sees no
body to describe. :func:`install_openapi` replaces ``app.openapi`` with FastAPI's document
post-processed from :data:`OPERATIONS`: request bodies and answers are the JSON schemas of the
very pydantic models the server validates with and answers from
(:mod:`mmis.frontend.api.schemas`), their ``$defs`` moved into ``components.schemas``.

Invariants:
- Every route of the app is in :data:`OPERATIONS` (:func:`undescribed` lists those that are
  not, and the unit test fails on any: a new route must say what it answers); an entry whose
  route the app lacks is left out.
- Every error status a route can answer is declared with :class:`ErrorResponse`, the shape of
  :func:`mmis.frontend.errors.error_body`; ``401`` (and the bearer security scheme) only when
  the server has an API key, on every route but the probes and ``/internal/*``
  (:mod:`mmis.frontend.api.http_gate`). ``/internal/*`` always declares its own scheme
  (``internal``: the internal token as a bearer token), ``401 invalid_internal_token`` and
  ``403 internal_routes_disabled``.
  ``499`` (client gone) is not declared: no client reads it.
- Limits are the running server's, read from ``app.state.mmis`` when the document is first
  asked for (after startup): ``n <= max_n``, ``max_tokens`` and ``max_completion_tokens`` at
  most the context window, ``model`` one of the served names; with ``--ops-port`` the
  operations routes (``http_gate.OPS_PATHS``) are left out (they answer on that port only).
  An app that never started (unit tests) gets the models' own bounds and is not cached.
- A stream (``text/event-stream``) is described one event at a time, as OpenAPI 3.1 readers
  such as schemathesis take ``schema`` of an event stream: ``data`` is a chunk, the error
  event, or ``[DONE]``.

Tested by ``tests/frontend/test_openapi.py`` (every body and ``$ref`` resolves) and
``tests/e2e/test_fuzz_openapi.py`` (a real ``mmis serve`` fuzzed against this document).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

import mmis
from mmis.frontend.api.http_gate import INTERNAL_PATHS, OPEN_PATHS, OPS_PATHS
from mmis.frontend.api.schemas import (
    BlockKeys,
    CacheStats,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelList,
    PrefixCacheReset,
    ProbeStatus,
    VersionInfo,
)
from mmis.frontend.api.schemas.responses_api import ResponseObject, ResponsesRequest

REF = "#/components/schemas/{model}"
JSON = "application/json"
SSE = "text/event-stream"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
BEARER = "bearer"
INTERNAL = "internal"  # the internal token's security scheme (/internal/*)

ERROR_TEXT: dict[int, str] = {
    400: "invalid request: schema or range (`param` names the field), text that is not valid "
    "Unicode (a lone surrogate such as `\\ud800`, refused before anything is rendered), a bad "
    "or too large image, a prompt beyond the context window",
    401: "missing or wrong API key (`code: invalid_api_key`)",
    403: "an image URL refused by policy (`code: media_forbidden`: private address, "
    "`file://` outside the allowed root)",
    404: "the request names a model this server does not serve (`code: model_not_found`)",
    413: "request body larger than the server's limit",
    415: "a content type other than application/json",
    422: "images sent by `uuid` only that the server no longer holds, or that the sender's "
    "tenant never sent with data (a uuid names an image for its tenant only) "
    "(`code: multimodal_cache_miss`, `missing_uuids`): resend them with their data",
    500: "internal error (the text is not leaked)",
    503: "the engine is unavailable, or the server is shutting down (`code: "
    "server_shutting_down`; both with `Retry-After`), or a multimodal cache miss after "
    "the one retry (`code: multimodal_cache_miss`, `retryable: true`)",
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying (the engine unavailable, the server "
        "shutting down)",
        "schema": {"type": "integer", "minimum": 0},
    }
}
BODY_ERRORS = (400, 403, 404, 413, 415, 422, 500, 503)
INTERNAL_401 = {
    "description": "missing or wrong internal token (`code: invalid_internal_token`); the "
    "API key does not open /internal/*",
    "content": {JSON: {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_DISABLED = (
    "the server has no internal token (`code: internal_routes_disabled`: set "
    "MMIS_FRONTEND_INTERNAL_TOKEN)"
)
INTERNAL_403 = {
    "description": _DISABLED,
    "content": {JSON: {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
INTERNAL_403_BODY = {
    **INTERNAL_403,
    "description": _DISABLED + ", or an image URL refused by policy (`code: media_forbidden`)",
}


@dataclasses.dataclass(frozen=True)
class Operation:
    """What one route takes and answers."""

    summary: str
    ok: dict[str, Any]  # the 200 response object (``$ref``s to ``components.schemas``)
    request: type[BaseModel] | None = None
    errors: tuple[int, ...] = (500,)
    other: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _ref(model)}}}


def _event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """One Server-Sent Event of a stream whose events carry ``chunk``."""
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": JSON,
                "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
            },
        ]
    }
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": data},
            "description": f"one event: `data: <{chunk.__name__} JSON>`; a stream that "
            'fails after its first byte sends the error event `data: {"error": ...}`; '
            "the last event is `data: [DONE]`",
        }
    }


def _generation(whole: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    return {
        "description": f"`stream: false`: one {whole.__name__}; `stream: true`: Server-Sent "
        f"Events of {chunk.__name__}, with `stream_options.include_usage` a last chunk with "
        "`choices: []` and the usage (`usage: null` on the others)",
        "content": {JSON: {"schema": _ref(whole)}, SSE: _event_stream(chunk)},
    }


def _probe(what: str) -> Operation:
    return Operation(
        summary=what,
        ok=_json(ProbeStatus, "up"),
        errors=(500, 503),
        other={503: _json(ProbeStatus, "not (yet) " + what.lower())},
    )


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        summary="Chat completion (text and images), whole or streamed",
        request=ChatCompletionRequest,
        ok=_generation(ChatCompletionResponse, ChatCompletionChunk),
        errors=BODY_ERRORS,
    ),
    ("POST", "/v1/completions"): Operation(
        summary="Text completion, whole or streamed",
        request=CompletionRequest,
        ok=_generation(CompletionResponse, CompletionResponse),
        errors=BODY_ERRORS,
    ),
    ("POST", "/v1/embeddings"): Operation(
        summary="Embeddings of texts, token ids or one multimodal input",
        request=EmbeddingRequest,
        ok=_json(EmbeddingResponse, "one embedding per input"),
        errors=BODY_ERRORS,
    ),
    ("POST", "/v1/responses"): Operation(
        summary="A response (the Responses API: text and images in, text out), whole or streamed",
        request=ResponsesRequest,
        ok={
            "description": "`stream: false`: one ResponseObject; `stream: true`: Server-Sent "
            "Events `event: <type>` + `data: <StreamEvent JSON>`, from `response.created` to "
            "`response.completed` (or `response.incomplete`)",
            "content": {
                JSON: {"schema": _ref(ResponseObject)},
                SSE: {"schema": {"type": "object", "description": "one StreamEvent"}},
            },
        },
        errors=BODY_ERRORS,
    ),
    ("GET", "/v1/models"): Operation(summary="The served model", ok=_json(ModelList, "models")),
    ("GET", "/health"): _probe("Alive: this front-end process answers (whatever the engine does)"),
    ("GET", "/ready"): _probe("Ready: a synthetic image request completed, the engine link is up"),
    ("GET", "/metrics"): Operation(
        summary="Prometheus metrics (text exposition, or OpenMetrics by Accept)",
        ok={
            "description": "the metrics registry",
            "content": {
                PROMETHEUS: {"schema": {"type": "string"}},
                OPENMETRICS: {"schema": {"type": "string"}},
            },
        },
    ),
    ("GET", "/stats/cache"): Operation(
        summary="The drift window of the multimodal cache (the operator's probe)",
        ok=_json(CacheStats, "rates and counts over the window"),
    ),
    ("POST", "/internal/block_keys"): Operation(
        summary="A chat request's prefix-cache block keys, for routers (nothing is served; "
        "the internal token only)",
        request=ChatCompletionRequest,
        ok=_json(
            BlockKeys,
            "the keys P1 will announce for the request's prompt blocks; a uuid-only image "
            "the request's tenant has no binding for is left out of `mm_hashes`, and the keys "
            "stop where it starts",
        ),
        errors=(401, *BODY_ERRORS),
        other={401: INTERNAL_401, 403: INTERNAL_403_BODY},
    ),
    ("POST", "/internal/reset_prefix_cache"): Operation(
        summary="P1 forgets its cached prefix blocks (announced to routers as "
        "AllBlocksCleared; the internal token only)",
        ok=_json(PrefixCacheReset, "how many blocks were forgotten"),
        errors=(401, 403, 500, 503),
        other={401: INTERNAL_401, 403: INTERNAL_403},
    ),
    ("GET", "/version"): Operation(
        summary="The mmis version", ok=_json(VersionInfo, "the serving package's version")
    ),
}

_REQUESTS = (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ResponsesRequest)
_RESPONSES = (
    ChatCompletionResponse,
    ResponseObject,
    ChatCompletionChunk,
    CompletionResponse,
    EmbeddingResponse,
    ModelList,
    ErrorResponse,
    ProbeStatus,
    CacheStats,
    BlockKeys,
    PrefixCacheReset,
    VersionInfo,
)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The running server's limits the document states (``None``: not known)."""

    max_n: int | None = None
    max_model_len: int | None = None
    model_names: tuple[str, ...] = ()
    api_key: bool = False
    ops_port: bool = False


def _limits(app: FastAPI) -> Limits | None:
    state = getattr(app.state, "mmis", None)
    if state is None:
        return None
    settings = state.settings
    return Limits(
        max_n=settings.max_n,
        max_model_len=state.max_model_len,
        model_names=tuple(settings.served_names),
        api_key=bool(settings.api_key),
        ops_port=settings.ops_port is not None,
    )


def component_schemas() -> dict[str, Any]:
    """Every request and response model's JSON schema, keyed by model name (refs resolve)."""
    pairs: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in _REQUESTS]
    pairs += [(m, "serialization") for m in _RESPONSES]
    keys, top = models_json_schema(pairs, ref_template=REF)
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    for (model, _), key in keys.items():
        name = key["$ref"].rsplit("/", 1)[1]
        if name != model.__name__:
            raise RuntimeError(f"{model.__name__} is in the document as {name}")
    return schemas


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of ``anyOf: [X, null]`` (or the schema itself)."""
    branch: dict[str, Any]
    for branch in schema.get("anyOf", []):
        if branch.get("type") != "null":
            return branch
    return schema


def _apply_limits(schemas: dict[str, Any], limits: Limits) -> None:
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[request]["properties"]
        if limits.max_n is not None:
            props["n"]["maximum"] = limits.max_n
            props["n"]["description"] = "choices; at most the server's max_n"
        for name in ("max_tokens", "max_completion_tokens"):
            if name in props and limits.max_model_len is not None:
                _not_null(props[name])["maximum"] = limits.max_model_len
                props[name]["description"] = (
                    "output tokens; prompt + max_tokens must fit the context window "
                    f"({limits.max_model_len} tokens), else a 400"
                )
    for request in ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest"):
        model = schemas[request]["properties"]["model"]
        if limits.model_names:
            _not_null(model)["enum"] = list(limits.model_names)
            model["description"] = "a served model (GET /v1/models); another name is a 404"


def _responses(op: Operation, limits: Limits, path: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": copy.deepcopy(op.ok)}
    errors = set(op.errors)
    if limits.api_key and path not in OPEN_PATHS:
        errors.add(401)  # the API key's (an /internal/* route's own 401 is in op.other)
    for status in sorted(errors):
        answer = op.other.get(status) or _json(ErrorResponse, ERROR_TEXT[status])
        answer = copy.deepcopy(answer)
        if status == 503:
            answer["headers"] = copy.deepcopy(RETRY_AFTER)
        responses[str(status)] = answer
    return responses


def build_document(app: FastAPI, limits: Limits) -> dict[str, Any]:
    """FastAPI's document of ``app`` with the bodies, answers and limits of :data:`OPERATIONS`."""
    doc = get_openapi(
        title=app.title,
        version=mmis.__version__,
        description="mmis: an OpenAI-compatible multimodal inference server",
        routes=app.routes,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(component_schemas())
    _apply_limits(schemas, limits)
    for method, route in _operations(app):
        op = OPERATIONS.get((method, route.path))
        if op is not None:
            entry = doc["paths"][route.path][method.lower()]
            entry["summary"] = op.summary
            entry["responses"] = _responses(op, limits, route.path)
            if op.request is not None:
                entry["requestBody"] = {
                    "required": True,
                    "content": {JSON: {"schema": _ref(op.request)}},
                }
            if route.path in INTERNAL_PATHS:
                entry["security"] = [{INTERNAL: []}]
            elif limits.api_key and route.path not in OPEN_PATHS:
                entry["security"] = [{BEARER: []}]
    if limits.ops_port:
        for path in OPS_PATHS:
            doc["paths"].pop(path, None)
    schemes: dict[str, Any] = {}
    if limits.api_key:
        schemes[BEARER] = {"type": "http", "scheme": "bearer"}
    if INTERNAL_PATHS & set(doc["paths"]):
        schemes[INTERNAL] = {
            "type": "http",
            "scheme": "bearer",
            "description": "the internal token (MMIS_FRONTEND_INTERNAL_TOKEN), for routers",
        }
    if schemes:
        doc["components"]["securitySchemes"] = schemes
    return doc


def _operations(app: FastAPI) -> list[tuple[str, APIRoute]]:
    return [
        (method, route)
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in sorted(route.methods or ())
    ]


def undescribed(app: FastAPI) -> list[str]:
    """The app's routes missing from :data:`OPERATIONS` (``"METHOD /path"``)."""
    return [f"{m} {r.path}" for m, r in _operations(app) if (m, r.path) not in OPERATIONS]


def install_openapi(app: FastAPI) -> None:
    """Serve :func:`build_document` of ``app`` as its OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        limits = _limits(app)
        doc = build_document(app, limits or Limits())
        if limits is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
