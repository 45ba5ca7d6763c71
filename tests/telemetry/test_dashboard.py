"""The generated Grafana dashboard and alert rules: up to date, valid PromQL, real metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import promql_parser
import pytest
import yaml

from mmis.telemetry import catalog

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "dashboards"))  # the generators: build tools
import gen_dashboards as generate  # noqa: E402
import mmis_alerts as alerts  # noqa: E402
import mmis_dashboard as dashboard  # noqa: E402

CHART = ROOT / "charts" / "mmis"
# Labels an expression may group or match by: ours, the histogram's, and the scrape's.
GROUPABLE = catalog.ALLOWED_LABELS | {"le", "pod", "namespace"}
CLOSED_SETS = {
    "endpoint": catalog.ENDPOINTS,
    "outcome": catalog.RETRY_OUTCOMES,
    "status": catalog.STATUS_CLASSES,
}


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's template variables with values, leaving plain PromQL."""
    return expr.replace("$__rate_interval", "5m").replace("$model", ".*")


def inspect(expr: str) -> tuple[set[str], set[str]]:
    """(metric names selected, label names grouped or matched by) of a PromQL expression."""
    names: set[str] = set()
    labels: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                labels.add(matcher.name)
                allowed = CLOSED_SETS.get(matcher.name)
                if allowed is not None and matcher.op == promql_parser.MatchOp.Equal:
                    assert matcher.value in allowed, f"{matcher.name}={matcher.value!r} in {expr}"
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names, labels


def all_expressions() -> list[tuple[str, str]]:
    exprs = [("dashboard", grafana_to_promql(e)) for e in dashboard.expressions()]
    return exprs + [("alerts", e) for e in alerts.expressions()]


def test_checked_in_files_equal_a_fresh_build() -> None:
    for rel, text in generate.outputs().items():
        path = CHART / rel
        assert path.is_file(), f"{path} missing: run scripts/gen-dashboard"
        assert path.read_text(encoding="utf-8") == text, (
            f"{path} is stale: run scripts/gen-dashboard"
        )
    assert generate.stale(CHART) == []


def test_check_mode_flags_a_hand_edit(tmp_path: Path) -> None:
    (tmp_path / "Chart.yaml").write_text("name: x\n")
    assert generate.main(["--chart", str(tmp_path)]) == 0
    assert generate.main(["--chart", str(tmp_path), "--check"]) == 0
    path = tmp_path / generate.DASHBOARD_FILE
    path.write_text(path.read_text().replace('"title": "mmis"', '"title": "edited"'))
    assert generate.main(["--chart", str(tmp_path), "--check"]) == 1
    assert generate.main(["--chart", str(tmp_path)]) == 0
    assert generate.stale(tmp_path) == []


def test_script_runs_in_check_mode() -> None:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gen-dashboard"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("where", "expr"), all_expressions())
def test_every_expression_parses_and_selects_only_catalog_metrics(where: str, expr: str) -> None:
    names, labels = inspect(expr)
    assert names, f"{where}: {expr} selects no metric"
    assert names <= catalog.series_names(), (
        f"{where}: unknown metrics {names - catalog.series_names()}"
    )
    assert labels <= GROUPABLE, f"{where}: unknown labels {labels - GROUPABLE}"


def test_the_checker_catches_bad_expressions() -> None:
    with pytest.raises(ValueError):
        inspect("sum(rate(mmis_shadow_hits_total[5m])")
    names, _ = inspect('rate(mmis_shadow_hit_total{model=~".*"}[5m])')
    assert not names <= catalog.series_names()
    with pytest.raises(AssertionError, match="outcome"):
        inspect('mmis_mm_retries_total{outcome="503"}')


def test_dashboard_covers_the_required_views() -> None:
    model = json.loads((CHART / generate.DASHBOARD_FILE).read_text())
    text = json.dumps(model)
    for needle in (
        "mmis_requests_total",
        "histogram_quantile(0.5, sum by (le) (rate(mmis_request_latency_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(mmis_request_latency_seconds_bucket",
        "mmis_time_to_first_token_seconds_bucket",
        "mmis_processor_cache_hits_total",
        "mmis_encoder_cache_hits_total",
        "mmis_prefix_cache_hits_total",
        "mmis_drift_rate",
        "sum by (endpoint, outcome) (rate(mmis_mm_retries_total",
        "mmis:num_requests_waiting",
        "mmis:num_requests_running",
        "mmis:kv_cache_usage_perc",
    ):
        assert needle in text, needle
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    positions = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in model["panels"]}
    assert len(positions) == len(ids), "panels overlap"
    variable_query = model["templating"]["list"][1]["query"]
    metric = re.fullmatch(r"label_values\((\S+), model\)", variable_query)
    assert metric is not None and metric.group(1) in catalog.series_names()


def test_alert_rules_file_is_a_prometheus_rule_file() -> None:
    rules = yaml.safe_load((CHART / generate.ALERTS_FILE).read_text())
    (group,) = rules["groups"]
    by_name = {r["alert"]: r for r in group["rules"]}
    assert set(by_name) == {
        "MMISHighDriftRate",
        "MMISRetryFailures",
        "MMISEngineDown",
        "MMISMetricsAbsent",
    }
    for rule in by_name.values():
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert 'outcome="failed"' in by_name["MMISRetryFailures"]["expr"]
    assert "mmis_engine_up" in by_name["MMISEngineDown"]["expr"]
    # the guard that makes "engine down" loud when nothing scrapes the front ends at all
    assert by_name["MMISMetricsAbsent"]["expr"] == "absent(mmis_engine_up)"
    assert str(alerts.DRIFT_RATE_THRESHOLD) in by_name["MMISHighDriftRate"]["expr"]
