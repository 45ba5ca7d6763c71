"""P0's spans for a drifted-then-retried request (in-memory exporter, scripted P1).

Real P0 and the real P1 shell and receiver cache; the drift is real: P1 silently drops every
cached item right before the request is resolved, so the shadow hit misses and the recovery
policy retries with the data. The trace must show both attempts under the one HTTP span, the
cache events, the GenAI attributes, and the context P1 received must name P0's ``engine``
span of each attempt.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend, ScriptedCore, image_part
from scripted_stack import scripted_stack

from mmis.protocol.messages import EngineCoreRequest
from mmis.telemetry import genai
from mmis.telemetry import tracing as tr
from mmis.telemetry.tracing import setup_tracing
from mmis.telemetry.tracing_config import TracingConfig

pytestmark = pytest.mark.timeout(180)


class ContextCore(ScriptedCore):
    """Remembers the trace context each request carried into P1."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: dict[str, dict[str, str]] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        self.contexts[request.request_id] = dict(request.trace_context)
        super().add_request(request)


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[FakeEngine, RunningFrontend, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(TracingConfig(), exporter=exporter)
    try:
        with scripted_stack(tmp_path, ContextCore(), tracing=tracing) as (engine, frontend):
            yield engine, frontend, exporter
    finally:
        tracing.shutdown()


def _server_spans(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The finished SERVER spans once ``count`` of them exist: the middleware ends a request's
    span after the response went out, so the client can read the reply first."""
    deadline = time.monotonic() + 10.0
    while True:
        servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
        if len(servers) >= count or time.monotonic() > deadline:
            return servers
        time.sleep(0.01)  # polling an observable condition with a deadline, not a fixed wait


def _events(span: ReadableSpan, name: str) -> list[dict[str, Any]]:
    return [dict(e.attributes or {}) for e in span.events if e.name == name]


def test_drifted_then_retried_request_shows_both_attempts_under_one_span(
    traced: tuple[FakeEngine, RunningFrontend, InMemorySpanExporter],
) -> None:
    engine, frontend, exporter = traced
    body = {
        "model": "tiny",
        "max_tokens": 3,
        "messages": [
            {"role": "user", "content": [image_part((7, 70, 170)), {"type": "text", "text": "x"}]}
        ],
    }
    with httpx.Client(timeout=30) as http:
        assert http.post(f"{frontend.base_url}/chat/completions", json=body).status_code == 200
        assert len(_server_spans(exporter, 1)) == 1
        exporter.clear()
        core = engine.core
        assert isinstance(core, ContextCore)
        core.contexts.clear()
        engine.evict_all_before_next()  # P1 silently loses the item the shadow remembers
        reply = http.post(f"{frontend.base_url}/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert http.get(f"{frontend.root_url}/metrics").status_code == 200

    servers = _server_spans(exporter, 1)
    spans = exporter.get_finished_spans()
    assert [s.name for s in servers] == ["chat tiny"]  # /metrics is not traced
    root = servers[0]
    attrs = dict(root.attributes or {})
    assert attrs[genai.OPERATION_NAME] == "chat" and attrs[genai.REQUEST_MODEL] == "tiny"
    usage = reply.json()["usage"]
    assert attrs[genai.USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert attrs[genai.USAGE_OUTPUT_TOKENS] == usage["completion_tokens"] == 3
    assert attrs[genai.USAGE_CACHE_READ_INPUT_TOKENS] == 0
    assert attrs["http.response.status_code"] == 200

    assert root.context is not None
    children = [
        s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id
    ]
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in sorted(children, key=lambda s: s.start_time or 0):
        by_name.setdefault(span.name, []).append(span)
    renders, engines = by_name["render"], by_name["engine"]
    assert [dict(s.attributes or {})[tr.ATTR_ATTEMPT] for s in renders] == [1, 2]
    assert [dict(s.attributes or {})[tr.ATTR_ATTEMPT] for s in engines] == [1, 2]
    first, second = (dict(s.attributes or {}) for s in renders)
    assert first["mmis.mm.cache_hits"] == 1 and first["mmis.mm.bytes_sent"] == 0
    assert second["mmis.mm.cache_hits"] == 0 and second["mmis.mm.bytes_sent"] > 0

    miss = _events(engines[0], tr.CACHE_MISS)
    assert miss == [{tr.ATTR_HASHES_COUNT: 1, tr.ATTR_ATTEMPT: 1, tr.ATTR_OUTCOME: "retrying"}]
    assert not engines[1].events
    invalidation = _events(root, tr.CACHE_INVALIDATION)
    assert invalidation == [
        {tr.ATTR_HASHES_COUNT: 1, tr.ATTR_ATTEMPT: 1, tr.ATTR_OUTCOME: "queued"}
    ]
    retry = _events(root, tr.RETRY)
    assert retry == [{tr.ATTR_HASHES_COUNT: 1, tr.ATTR_ATTEMPT: 2, tr.ATTR_OUTCOME: "success"}]

    # the retry reached P1's core with the context of its own engine span (the first attempt
    # was answered by P1's input thread with the miss, before the core)
    (sent,) = core.contexts.values()
    _, trace_id, parent_id, _ = sent["traceparent"].split("-")
    assert trace_id == f"{root.context.trace_id:032x}"
    assert parent_id == f"{engines[1].context.span_id:016x}"  # type: ignore[union-attr]


def test_tracing_off_sends_no_context_and_builds_no_provider(tmp_path: Path) -> None:
    with scripted_stack(tmp_path, ContextCore()) as (engine, frontend):
        assert frontend.state is not None and not frontend.state.tracing.enabled
        with httpx.Client(timeout=30) as http:
            reply = http.post(
                f"{frontend.base_url}/completions", json={"prompt": "hi", "max_tokens": 2}
            )
            assert reply.status_code == 200
        core = engine.core
        assert isinstance(core, ContextCore)
        assert core.contexts and all(ctx == {} for ctx in core.contexts.values())
