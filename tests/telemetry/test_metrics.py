"""The per-process registry, the catalog's label policy, and the exposition a scrape sees."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from mmis.telemetry import catalog
from mmis.telemetry.catalog import ALLOWED_LABELS, Owner
from mmis.telemetry.drift import DriftCollector, DriftWindow, counters_of
from mmis.telemetry.engine_stats import KEYS, EngineStats
from mmis.telemetry.errors import LabelValueError, TelemetryError
from mmis.telemetry.lora_info import LoRAInfoCollector
from mmis.telemetry.metrics import MMISMetrics
from mmis.telemetry.stats_collector import EngineStatsCollector

CHAT = "/v1/chat/completions"
# Label names that would carry per-request values: none may ever appear on a series.
PER_REQUEST = {"request_id", "mm_hash", "hash", "uuid", "identifier", "trace_id", "prompt"}


def full_registry() -> MMISMetrics:
    """A P0 registry with every kind of figure recorded, as a live /metrics would have."""
    metrics = MMISMetrics("tiny-vlm")
    engine = EngineStatsCollector("tiny-vlm")
    engine.update(EngineStats(num_requests_waiting=2, encoder_cache_queries=3).to_dict())
    metrics.attach(engine)
    metrics.attach(DriftCollector(DriftWindow(counters_of(metrics)), "tiny-vlm"))
    metrics.attach(LoRAInfoCollector("tiny-vlm", lambda: ["lm"]))  # a P0 with LoRA on
    metrics.processor_cache(queries=4, hits=3)
    metrics.shadow_hits(3)
    metrics.drift_misses(1)
    metrics.invalidations(1)
    metrics.retry(CHAT, "success")
    metrics.encoder_request("ok")
    metrics.encoder_fallback("timeout")
    metrics.request_finished(CHAT, 200, 0.8, prompt_tokens=12, generation_tokens=5)
    metrics.first_token(CHAT, 0.1)
    metrics.output_tokens(CHAT, [0.02, 0.03])
    return metrics


def scrape(metrics: MMISMetrics) -> dict[str, prometheus_client.Metric]:
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_each_instance_owns_its_registry_and_the_default_stays_clean() -> None:
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    a, b = MMISMetrics("m"), MMISMetrics("m")  # would collide in one shared registry
    a.shadow_hits(2)
    assert a.total(catalog.SHADOW_HITS) == 2
    assert b.total(catalog.SHADOW_HITS) == 0
    assert set(prometheus_client.REGISTRY._names_to_collectors) == before
    assert not any(n.startswith("mmis") for n in prometheus_client.REGISTRY._names_to_collectors)


def test_explicit_registry_is_used() -> None:
    registry = CollectorRegistry()
    MMISMetrics("m", registry=registry).drift_misses(3)
    assert registry.get_sample_value("mmis_drift_misses_total", {"model": "m"}) == 3


def test_no_exposed_series_carries_a_per_request_label() -> None:
    families = scrape(full_registry())
    labels_seen = set()
    for family in families.values():
        for sample in family.samples:
            labels_seen |= set(sample.labels) - {"le"}
    assert labels_seen, "the scrape exposed no labelled series at all"
    assert labels_seen <= ALLOWED_LABELS, labels_seen - ALLOWED_LABELS
    assert not labels_seen & PER_REQUEST
    # every catalog metric shows up, so the scan above really covered all of them
    exposed = {s.name for f in families.values() for s in f.samples}
    # (every one a P0 exposes: mmis encoder's own are on its port, tests/encoder/)
    p0 = {n for spec in catalog.ALL if spec.owner is not Owner.ENCODER for n in spec.series_names}
    assert p0 <= exposed, p0 - exposed


def test_catalog_declares_only_allowed_labels() -> None:
    for spec in catalog.ALL:
        assert set(spec.labels) <= ALLOWED_LABELS, spec.name
        assert "model" in spec.labels, spec.name


def test_gateway_inference_extension_gauges_are_exposed_as_gauges() -> None:
    families = scrape(full_registry())
    for name in (
        "mmis:num_requests_waiting",
        "mmis:num_requests_running",
        "mmis:kv_cache_usage_perc",
    ):
        assert families[name].type == "gauge", name
    waiting = families["mmis:num_requests_waiting"].samples[0]
    assert waiting.value == 2 and waiting.labels == {"model": "tiny-vlm"}


def test_engine_stats_keys_match_the_catalog() -> None:
    keys = {key for s in catalog.ALL if s.owner is Owner.ENGINE for key in s.snapshot_keys}
    assert keys - {"up"} == KEYS


def test_label_values_outside_their_closed_set_are_rejected() -> None:
    metrics = MMISMetrics("m")
    with pytest.raises(LabelValueError, match="endpoint"):
        metrics.retry("/v1/chat/completions?id=123", "success")
    with pytest.raises(LabelValueError, match="outcome"):
        metrics.retry(CHAT, "sha256:abcd")
    with pytest.raises(LabelValueError, match="endpoint"):
        metrics.first_token("/v1/req-42", 0.1)
    assert metrics.total(catalog.RETRIES) == 0


def test_bad_figures_raise_typed_errors() -> None:
    metrics = MMISMetrics("m")
    with pytest.raises(TelemetryError, match="hits exceed"):
        metrics.processor_cache(queries=1, hits=2)
    with pytest.raises(TelemetryError, match="only go up"):
        metrics.shadow_hits(-1)
    with pytest.raises(TelemetryError, match="status"):
        metrics.request_finished(CHAT, 42, 0.1)
    with pytest.raises(TelemetryError, match="negative"):
        metrics.first_token(CHAT, -0.5)
    with pytest.raises(TelemetryError, match="model"):
        MMISMetrics("")


def test_requests_are_counted_by_status_class_with_tokens_and_latency() -> None:
    metrics = MMISMetrics("m")
    metrics.request_finished(CHAT, 503, 2.0, prompt_tokens=10)
    metrics.request_finished(CHAT, 200, 0.5, prompt_tokens=10, generation_tokens=7)
    r = metrics.registry
    assert (
        r.get_sample_value("mmis_requests_total", {"model": "m", "endpoint": CHAT, "status": "5xx"})
        == 1
    )
    assert (
        r.get_sample_value("mmis_requests_total", {"model": "m", "endpoint": CHAT, "status": "2xx"})
        == 1
    )
    assert r.get_sample_value("mmis_prompt_tokens_total", {"model": "m"}) == 20
    assert r.get_sample_value("mmis_generation_tokens_total", {"model": "m"}) == 7
    labels = {"model": "m", "endpoint": CHAT}
    assert r.get_sample_value("mmis_request_latency_seconds_count", labels) == 2
    assert r.get_sample_value("mmis_request_latency_seconds_sum", labels) == 2.5
    assert r.get_sample_value("mmis_request_latency_seconds_bucket", {**labels, "le": "1.0"}) == 1


def test_exposition_negotiates_openmetrics() -> None:
    body, content_type = full_registry().exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
