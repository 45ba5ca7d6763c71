"""Traces and metrics across P0 and a real P1 process (the tiny LLaVA on CPU).

P1 is a real ``mmis engine`` started with ``--otlp-traces-endpoint`` (protocol from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``) and ``--fault-evict-rate 1``: every shadow hit
misses, so the second request for the same image is drifted, then healed by the retry. It
exports to a real OTLP/HTTP receiver on loopback; P0 runs in this process with an in-memory
exporter. The two span lists are joined by trace id and parent span id. Waits are bounded
polls of the receiver (P1's batch exporter flushes on its own schedule), never sleeps.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "frontend"))
sys.path.insert(0, str(Path(__file__).parents[1] / "telemetry"))
from fake_engine import RunningFrontend
from otlp_receiver import ExportRequest, serve_otlp_http, service_spans
from procs import Engine, chat_body
from scripted_stack import tiny_settings

from mmis.telemetry import genai
from mmis.telemetry.tracing import setup_tracing
from mmis.telemetry.tracing_config import TracingConfig
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]


class Receiver:
    """A minimal OTLP/HTTP traces receiver: (service, trace id, span id, parent, name, attrs)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, request: ExportRequest, path: str) -> None:
        with self.lock:
            for service, s in service_spans(request):
                self.spans.append(
                    {
                        "service": service,
                        "trace": s.trace_id.hex(),
                        "id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "name": s.name,
                        "attrs": {a.key: _value(a.value) for a in s.attributes},
                    }
                )

    def in_trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def receiver() -> Iterator[tuple[str, Receiver]]:
    received = Receiver()
    with serve_otlp_http(received.add) as base:
        yield f"{base}/v1/traces", received


def _wait(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout}s")
        time.sleep(0.1)  # polling another process's export; not a synchronisation


def test_drifted_request_traced_across_p0_and_p1_and_p1_figures_on_metrics(
    tmp_path: Path, receiver: tuple[str, Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, received = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    model = tiny_model_dir()
    engine = Engine(
        "engine", model, tmp_path, "--fault-evict-rate", "1", "--otlp-traces-endpoint", endpoint
    )
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(TracingConfig(), exporter=exporter)
    settings = tiny_settings(engine, stats_interval_s=0.5)
    frontend: RunningFrontend | None = None
    try:
        frontend = RunningFrontend(settings, tracing=tracing).start(timeout=300)
        with httpx.Client(timeout=120) as http:
            for _ in range(2):  # the second one is a shadow hit that P1 evicted on purpose
                reply = http.post(
                    f"{frontend.base_url}/chat/completions", json=chat_body((5, 6, 7))
                )
                assert reply.status_code == 200, reply.text
            answer = reply.json()
            miss = 'mmis_receiver_cache_queries_total{model="tiny"} 1.0'
            metrics = _wait(  # P1's figures are polled: the miss shows within one interval
                "P1's receiver miss on /metrics",
                lambda: (text := http.get(f"{frontend.root_url}/metrics").text) * (miss in text),
            )
    finally:
        if frontend is not None:
            frontend.stop()
        engine.stop()
        tracing.shutdown()

    servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert [s.name for s in servers] == ["chat tiny", "chat tiny"]
    clean, drifted = servers
    p0 = exporter.get_finished_spans()

    def p0_engine_spans(root: Any) -> list[Any]:
        root_id = root.context.span_id
        return sorted(
            (s for s in p0 if s.name == "engine" and s.parent and s.parent.span_id == root_id),
            key=lambda s: s.start_time,
        )

    # the drifted request: two engine round trips under its one HTTP span; only the retry
    # reached P1's core, and P1's span is the child of that retry's engine span
    first, retry = p0_engine_spans(drifted)
    trace_id = f"{drifted.context.trace_id:032x}"
    p1 = _wait("P1 span for the retry", lambda: received.in_trace(trace_id))
    (core,) = [s for s in p1 if s["name"] == "engine_core"]
    assert core["service"] == "mmis-engine"
    assert core["parent"] == f"{retry.context.span_id:016x}"
    assert core["attrs"][genai.USAGE_OUTPUT_TOKENS] == answer["usage"]["completion_tokens"]
    assert core["attrs"][genai.USAGE_INPUT_TOKENS] == answer["usage"]["prompt_tokens"]
    assert core["attrs"]["mmis.finish_reason"] == answer["choices"][0]["finish_reason"]
    phases = {s["name"] for s in p1 if s["parent"] == core["id"]}
    assert {"queue", "prefill", "decode"} <= phases
    assert not any(s["parent"] == f"{first.context.span_id:016x}" for s in p1)

    # the clean request's P1 span shows the vision encoder run
    clean_trace = f"{clean.context.trace_id:032x}"
    spans = _wait("P1 spans of the clean request", lambda: received.in_trace(clean_trace))
    (clean_core,) = [s for s in spans if s["name"] == "engine_core"]
    encoder = [s for s in spans if s["name"] == "encoder" and s["parent"] == clean_core["id"]]
    assert encoder and encoder[0]["attrs"]["mmis.encoder.items"] == 1

    # /metrics: P1's figures (polled) under their names, the GIE gauges, the drift counters
    lines = {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    tiny = '{model="tiny"}'
    assert lines[f"mmis_engine_up{tiny}"] == 1.0
    for gauge in ("mmis:num_requests_waiting", "mmis:num_requests_running"):
        assert lines[f"{gauge}{tiny}"] >= 0.0
    assert 0.0 <= lines[f"mmis:kv_cache_usage_perc{tiny}"] <= 1.0
    assert lines[f"mmis_prefix_cache_queries_total{tiny}"] > 0
    assert lines[f"mmis_receiver_cache_queries_total{tiny}"] >= 1
    assert lines[f"mmis_drift_misses_total{tiny}"] >= 1
    success = (
        'mmis_mm_retries_total{endpoint="/v1/chat/completions",model="tiny",outcome="success"}'
    )
    assert lines[success] == 1.0
