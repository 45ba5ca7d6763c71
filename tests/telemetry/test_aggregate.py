"""N P0 processes' figures as one answer: the labelled exposition, the merge, the summed window.

Real registries (:class:`FrontendTelemetry`, as each P0 builds it), real OpenMetrics text
between them, parsed back with prometheus_client's own parsers.
"""

from __future__ import annotations

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from mmis.telemetry import catalog
from mmis.telemetry.aggregate import OPENMETRICS, merge_expositions, sum_drift_stats
from mmis.telemetry.bundle import FrontendTelemetry
from mmis.telemetry.errors import LabelValueError, TelemetryError
from mmis.telemetry.metrics import ENGINE_FAMILIES

CHAT = "/v1/chat/completions"


def _process(requests: int, hits: int = 0, misses: int = 0) -> FrontendTelemetry:
    telemetry = FrontendTelemetry.create("tiny")
    telemetry.engine_stats.update({"num_requests_running": 3, "receiver_cache_queries": 5})
    for _ in range(requests):
        telemetry.metrics.request_finished(CHAT, 200, 0.1)
    telemetry.metrics.processor_cache(queries=hits + 1, hits=hits)
    telemetry.metrics.shadow_hits(hits)
    telemetry.metrics.drift_misses(misses)
    return telemetry


def _own(telemetry: FrontendTelemetry, index: str) -> str:
    body, content_type = telemetry.metrics.exposition(OPENMETRICS, api_server=index)
    assert content_type.startswith("application/openmetrics-text")
    return body.decode()


def _samples(body: bytes, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in parse_text(body.decode())
        for sample in family.samples
        if sample.name == name
    ]


def test_one_process_exposition_is_unchanged_without_an_index() -> None:
    telemetry = _process(requests=2)
    plain, _ = telemetry.metrics.exposition()
    assert b"api_server" not in plain


def test_every_p0_family_carries_the_index_and_p1_figures_do_not() -> None:
    text = _own(_process(requests=2), "5")
    families = list(parse_om(text))
    assert {f.name for f in families if f.name in ENGINE_FAMILIES}  # P1's figures are there
    for family in families:
        for sample in family.samples:
            labelled = "api_server" in sample.labels
            assert labelled == (family.name not in ENGINE_FAMILIES), sample
            if labelled:
                assert sample.labels["api_server"] == "5"


@pytest.mark.parametrize("index", ["64", "-1", "a"])
def test_the_index_is_a_closed_set(index: str) -> None:
    with pytest.raises(LabelValueError):
        _process(requests=0).metrics.exposition(OPENMETRICS, api_server=index)
    assert "63" in catalog.API_SERVER_INDICES and len(catalog.API_SERVER_INDICES) == 64


def test_merge_keeps_every_process_and_p1_once() -> None:
    a, b = _process(requests=2), _process(requests=3)
    body, content_type = merge_expositions(_own(a, "0"), [_own(b, "1")], None)
    assert content_type.startswith("text/plain")
    requests = _samples(body, "mmis_requests_total")
    assert sorted((s["api_server"], v) for s, v in requests) == [("0", 2.0), ("1", 3.0)]
    assert _samples(body, "mmis_num_requests_running") == [({"model": "tiny"}, 3.0)]
    assert _samples(body, "mmis:num_requests_running") == [({"model": "tiny"}, 3.0)]
    assert len(_samples(body, "mmis_engine_up")) == 1


def test_merge_answers_openmetrics_when_asked() -> None:
    a, b = _process(requests=2), _process(requests=3)
    body, content_type = merge_expositions(_own(a, "0"), [_own(b, "1")], OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in parse_om(body.decode())}
    assert [s.value for s in families["mmis:num_requests_running"].samples] == [3.0]
    totals = [s for s in families["mmis_requests"].samples if s.name.endswith("_total")]
    assert sorted(s.labels["api_server"] for s in totals) == ["0", "1"]


def test_a_sibling_that_does_not_parse_is_left_out_whole() -> None:
    a, b = _process(requests=2), _process(requests=3)
    broken = _own(b, "1")[:200]  # cut mid-answer: no "# EOF"
    body, _ = merge_expositions(_own(a, "0"), [broken], None)
    assert [s["api_server"] for s, _ in _samples(body, "mmis_requests_total")] == ["0"]


def test_drift_windows_sum_and_rates_come_from_the_sums() -> None:
    a = _process(requests=4, hits=10, misses=1)
    b = _process(requests=6, hits=30, misses=7)
    one, two = a.drift.stats(), b.drift.stats()
    total = sum_drift_stats([one, two])
    assert list(total) == list(one)  # the operator's probe reads this exact shape
    assert total["requests"] == 10 and total["shadow_hits"] == 40 and total["drift_misses"] == 8
    assert total["drift_rate"] == pytest.approx(8 / 40)  # not the mean of 0.1 and 0.233
    assert total["hit_rate"] == pytest.approx(40 / 42)
    assert total["span_seconds"] == max(one["span_seconds"], two["span_seconds"])
    assert sum_drift_stats([one]) == pytest.approx(one)
    with pytest.raises(TelemetryError):
        sum_drift_stats([])
