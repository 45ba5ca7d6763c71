"""A drifted request traced end to end into a real Jaeger (v2 all-in-one, in-memory storage).

``mmis serve`` (P0 in it, P1 its child) exports both processes' spans over OTLP/gRPC to a
Jaeger on loopback (``tests/tools.py``), with ``--fault-evict-rate 1``: P1 evicts every
cached item, so the second request for the same image is a shadow hit that misses in P1,
is invalidated in P0's shadow and retried once with data, and answers 200. The test then
reads Jaeger's own query API (``/api/traces``, Jaeger's JSON: spans, ``processes`` with the
service names, span ``logs`` for the OpenTelemetry events) and asserts ONE trace holds:

- spans of both services, ``mmis-frontend`` and ``mmis-engine``;
- the ``mm_cache_miss``, ``mm_cache_invalidation`` and ``mm_retry`` events;
- P1's ``engine_core`` span as the child of the retry's P0 ``engine`` span (the trace context
  crossed the ZMQ hop), with its ``queue``/``prefill``/``decode`` phases.

Jaeger and serve are terminated in teardown. Waits are bounded polls of Jaeger's API (the
exporters batch on their own schedule), never sleeps standing in for synchronisation.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from procs import Serve, chat_body
from tools import Jaeger, go_tool, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

EVENTS = {"mm_cache_miss", "mm_cache_invalidation", "mm_retry"}
SERVICES = {"mmis-frontend", "mmis-engine"}


@pytest.fixture
def jaeger(tmp_path: Path) -> Iterator[Jaeger]:
    running = Jaeger.start(go_tool("jaeger"), tmp_path)
    try:
        yield running
    finally:
        running.stop()


def _events(span: dict[str, Any]) -> set[str]:
    return {
        f["value"] for log in span.get("logs", []) for f in log["fields"] if f["key"] == "event"
    }


def _drifted_trace(jaeger: Jaeger) -> dict[str, Any] | None:
    """The trace with every cache event and both services' spans, once it is all stored."""
    for trace in jaeger.traces("mmis-frontend"):
        spans: list[dict[str, Any]] = trace["spans"]  # type: ignore[assignment]
        processes: dict[str, Any] = trace["processes"]  # type: ignore[assignment]
        services = {processes[s["processID"]]["serviceName"] for s in spans}
        events = set().union(*(_events(s) for s in spans))
        if services >= SERVICES and events >= EVENTS:
            return trace
    return None


def test_drifted_request_is_one_trace_across_frontend_and_engine_in_jaeger(
    tmp_path: Path, jaeger: Jaeger
) -> None:
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OMP_NUM_THREADS": "1"}
    serve = Serve(
        tmp_path,
        "--fault-evict-rate",
        "1",
        "--otlp-traces-endpoint",
        jaeger.otlp_grpc,
        env=env,
    )
    try:
        serve.wait_http("/ready", 300)
        with httpx.Client(timeout=120) as http:
            for _ in range(2):  # the second is a shadow hit that P1 evicted on purpose
                reply = http.post(
                    f"{serve.root_url}/v1/chat/completions", json=chat_body((9, 8, 7))
                )
                assert reply.status_code == 200, reply.text
        trace = wait_until(
            "the drifted trace in jaeger", lambda: _drifted_trace(jaeger), 60, jaeger
        )
    finally:
        serve.stop()
    assert isinstance(trace, dict)
    spans: list[dict[str, Any]] = trace["spans"]
    service = {s["spanID"]: trace["processes"][s["processID"]]["serviceName"] for s in spans}
    assert len({s["traceID"] for s in spans}) == 1

    (root,) = [s for s in spans if s["operationName"] == "chat tiny"]
    assert service[root["spanID"]] == "mmis-frontend"
    assert {"mm_cache_invalidation", "mm_retry"} <= _events(root)

    def parent(span: dict[str, Any]) -> str | None:
        refs = [r["spanID"] for r in span.get("references", []) if r["refType"] == "CHILD_OF"]
        return refs[0] if refs else None

    attempts = sorted(
        (s for s in spans if s["operationName"] == "engine" and parent(s) == root["spanID"]),
        key=lambda s: s["startTime"],
    )
    assert len(attempts) == 2, [s["operationName"] for s in spans]
    first, retry = attempts
    assert "mm_cache_miss" in _events(first)
    (core,) = [s for s in spans if s["operationName"] == "engine_core"]
    assert service[core["spanID"]] == "mmis-engine"
    assert parent(core) == retry["spanID"]  # the context crossed P0 -> P1 on the retry
    phases = {s["operationName"] for s in spans if parent(s) == core["spanID"]}
    assert {"queue", "prefill", "decode"} <= phases
