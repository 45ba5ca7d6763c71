"""``GET /openapi.json`` (``server/mmis/frontend/api/openapi.py``): complete, resolvable, honest.

- Every route of the app is described; every POST route has a JSON request body referencing
  the model it is parsed with; every ``$ref`` resolves; the error statuses are declared.
- The running server's limits (max_n, context window, served names, API key, ops port)
  reach the document.
- The request schemas and the validators agree: bodies :func:`parse_request` accepts are
  valid against the document, bodies it refuses (a 400) are invalid against it.

The real server's answers against the document: ``tests/e2e/test_fuzz_openapi.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from fastapi import FastAPI

from mmis.frontend.api.api_server import create_app
from mmis.frontend.api.http_gate import INTERNAL_PATHS
from mmis.frontend.api.openapi import OPERATIONS, Limits, build_document, undescribed
from mmis.frontend.api.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    EmbeddingRequest,
    ErrorResponse,
    parse_request,
)
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import InvalidRequestError

BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/v1/responses": "ResponsesRequest",
    "/internal/block_keys": "ChatCompletionRequest",  # an operations route (routers)
}
BODYLESS_POSTS = {"/internal/reset_prefix_cache"}  # an operations action without a body
LIMITS = Limits(max_n=3, max_model_len=64, model_names=("tiny", "alias"), api_key=True)


@pytest.fixture(scope="module")
def app() -> FastAPI:
    settings = FrontendConfig(
        model="m", engine_input_address="ipc:///nowhere-in", engine_output_address="ipc:///out"
    )
    return create_app(settings)


@pytest.fixture(scope="module")
def doc(app: FastAPI) -> dict[str, Any]:
    return app.openapi()


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def _validator(doc: dict[str, Any], name: str) -> jsonschema_rs.Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema_rs.Draft202012Validator(schema)


def test_every_route_is_described(app: FastAPI, doc: dict[str, Any]) -> None:
    assert undescribed(app) == []
    for path, item in doc["paths"].items():
        for method, entry in item.items():
            ok = entry["responses"]["200"]
            assert ok["content"], f"{method} {path}: 200 without content"
            for media in ok["content"].values():
                assert media["schema"], f"{method} {path}: an empty 200 schema"
            assert "500" in entry["responses"], f"{method} {path}"


def test_post_routes_declare_their_body_and_errors(doc: dict[str, Any]) -> None:
    posts = {path for path, item in doc["paths"].items() if "post" in item}
    assert posts == set(BODIES) | BODYLESS_POSTS
    for path in BODYLESS_POSTS:
        entry = doc["paths"][path]["post"]
        assert "requestBody" not in entry
        assert {"500", "503"} <= set(entry["responses"]), path
    for path, model in BODIES.items():
        entry = doc["paths"][path]["post"]
        body = entry["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        responses = entry["responses"]
        for status in ("400", "403", "404", "413", "415", "422", "500", "503"):
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (path, status)
        assert "Retry-After" in responses["503"]["headers"]
        if path in INTERNAL_PATHS:  # the internal token's own 401, whatever the API key
            assert "invalid_internal_token" in responses["401"]["description"]
            assert "internal_routes_disabled" in responses["403"]["description"]
            assert entry["security"] == [{"internal": []}]
        else:
            assert "401" not in responses  # no API key configured
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}


def test_every_ref_resolves(doc: dict[str, Any]) -> None:
    refs = set(_refs(doc))
    assert "#/components/schemas/ChatCompletionChunk" in refs
    for ref in refs:
        _resolve(doc, ref)
    for name in doc["components"]["schemas"]:
        _validator(doc, name)  # compiles: every keyword and reference is well formed


def test_the_running_servers_limits_reach_the_document(app: FastAPI) -> None:
    doc = build_document(app, LIMITS)
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == 3
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 64
    assert chat["max_completion_tokens"]["anyOf"][0]["maximum"] == 64
    assert schemas["EmbeddingRequest"]["properties"]["model"]["anyOf"][0]["enum"] == [
        "tiny",
        "alias",
    ]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, item in doc["paths"].items():
        for entry in item.values():
            keyed = path not in ("/health", "/ready")
            assert ("401" in entry["responses"]) is keyed, path
            assert ("security" in entry) is keyed, path
    ops = {"/metrics", "/stats/cache", "/internal/block_keys"}
    assert ops <= set(doc["paths"])
    split = build_document(app, Limits(ops_port=True))
    assert not ops & set(split["paths"])
    assert set(OPERATIONS) >= {(m.upper(), p) for p, i in doc["paths"].items() for m in i}


USER = {"role": "user", "content": "hi"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
CHAT = ChatCompletionRequest


def said(role: str, *parts: Any) -> dict[str, Any]:
    """A chat body with one ``role`` message made of ``parts``."""
    return {"messages": [{"role": role, "content": list(parts)}]}


def ask(**fields: Any) -> dict[str, Any]:
    return {"messages": [USER], **fields}


ACCEPTED: list[tuple[type, dict[str, Any]]] = [
    (CHAT, ask()),
    (CHAT, {"messages": [{"role": "assistant"}, USER], "n": 3}),
    (CHAT, said("user", IMAGE)),
    (CHAT, said("user", {**IMAGE, "uuid": "u"})),
    (CHAT, said("user", {"type": "image_url", "uuid": "u"})),
    (CHAT, said("user", {"type": "image_url", "image_url": "https://x/y.png"})),
    (CHAT, said("system", {"type": "text", "text": "be brief"})),
    (CHAT, ask(stream=True, stream_options={})),
    (CHAT, ask(tool_choice="none", tools=[])),
    (CHAT, ask(response_format={"type": "text"})),
    (CHAT, ask(logprobs=True, top_logprobs=20)),
    (CHAT, ask(stop=["a", "b"], max_tokens=64, model="tiny")),
    (CHAT, ask(unknown_extension={"x": 1})),
    (CompletionRequest, {"prompt": "x"}),
    (CompletionRequest, {"prompt": "x", "logprobs": 5}),
    (CompletionRequest, {"prompt": [1, 2], "best_of": 1, "echo": False, "suffix": ""}),
    (CompletionRequest, {"prompt": [0, 2**31 - 1], "echo": True, "suffix": {}}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}),
    (CHAT, ask(response_format={"type": "json_schema", "json_schema": {"name": "n"}})),
    (EmbeddingRequest, {"input": ["a", "b"], "encoding_format": "base64"}),
    (EmbeddingRequest, {"input": [3, 4]}),
    (EmbeddingRequest, {"input": [IMAGE, {"type": "text", "text": "t"}], "model": "alias"}),
]

REFUSED: list[tuple[type, dict[str, Any]]] = [
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"role": "user"}]}),
    (CHAT, said("system", IMAGE)),
    (CHAT, said("user", {"type": "image_url"})),
    (CHAT, said("user", {"type": "image_url", "image_url": {}})),
    (CHAT, said("user", {"type": {}, "text": ""})),  # once a 500 (an unhashable tag)
    (CHAT, ask(n=4)),
    (CHAT, ask(n=True)),
    (CHAT, ask(temperature="0.5")),
    (CHAT, ask(stream="yes")),
    (CHAT, ask(stream_options={})),
    (CHAT, ask(stop=[""])),
    (CHAT, ask(stop=["s"] * 17)),
    (CHAT, ask(tools=[{"type": "function"}])),
    (CHAT, ask(logprobs=True, top_logprobs=21)),
    (CompletionRequest, {"prompt": "x", "logprobs": 6}),
    (CompletionRequest, {"prompt": ""}),
    (CompletionRequest, {"prompt": [1, -2]}),
    (CompletionRequest, {"prompt": "x", "echo": 0.0}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"grammar": "g", "regex": "r"}}),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}),
    (CompletionRequest, {"prompt": "x", "best_of": True}),  # true is not 1 (was accepted)
    (CompletionRequest, {"prompt": [4009, 2**98]}),  # once a 500 (past the wire's 64 bits)
    (EmbeddingRequest, {"input": [2**31]}),
    (EmbeddingRequest, {"input": []}),
    (EmbeddingRequest, {"input": ["a", 1]}),
    (EmbeddingRequest, {"input": [{"type": {}}]}),
    (EmbeddingRequest, {"input": "x", "dimensions": 8}),
]


def _label(case: tuple[type, dict[str, Any]]) -> str:
    return f"{case[0].__name__}:{case[1]}"[:90]


@pytest.mark.parametrize("case", ACCEPTED, ids=_label)
def test_what_the_server_accepts_the_document_accepts(
    app: FastAPI, case: tuple[type, dict[str, Any]]
) -> None:
    model, body = case
    parse_request(model, body, max_n=3)
    doc = build_document(app, LIMITS)
    errors = [e.message for e in _validator(doc, model.__name__).iter_errors(body)]
    assert errors == [], body


@pytest.mark.parametrize("case", REFUSED, ids=_label)
def test_what_the_server_refuses_the_document_refuses(
    app: FastAPI, case: tuple[type, dict[str, Any]]
) -> None:
    model, body = case
    with pytest.raises(InvalidRequestError):
        parse_request(model, body, max_n=3)
    doc = build_document(app, LIMITS)
    assert not _validator(doc, model.__name__).is_valid(body), body


def test_answers_conform() -> None:
    """Shapes the server writes (``usage: null`` on chunks, null finish reasons) are valid."""
    doc = build_document(FastAPI(), Limits())
    chunk = ChatCompletionChunk.model_validate(
        {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    )
    whole = ChatCompletionResponse.model_validate(
        {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "length"}],
        }
    )
    error = ErrorResponse.model_validate(
        {
            "error": {
                "message": "m",
                "type": "t",
                "param": None,
                "code": "multimodal_cache_miss",
                "retryable": True,
                "missing_uuids": ["u"],
            }
        }
    )
    for model in (chunk, whole, error):
        body = model.model_dump(mode="json")
        assert _validator(doc, type(model).__name__).is_valid(body), body
    assert chunk.model_dump(mode="json")["usage"] is None
