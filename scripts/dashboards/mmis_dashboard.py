"""The mmis Grafana dashboard, as code (``scripts/gen-dashboard`` writes it to the chart).

Invariants:
- Every expression selects only metrics from ``server/mmis/telemetry/catalog.py`` (a test
  parses each one with a real PromQL parser and checks the names), through the
  ``$datasource`` and ``$model`` template variables; ``$__rate_interval`` is Grafana's own.
- The output is deterministic (stable panel ids, sorted keys), so the checked-in JSON can be
  compared byte for byte with a fresh build.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

UID = "mmis-overview"
SEL = '{model=~"$model"}'
RI = "[$__rate_interval]"


@dataclasses.dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    description: str
    targets: tuple[Target, ...]
    max: float | None = None


def _rate(name: str, by: str = "", extra: str = "") -> str:
    selector = SEL if not extra else SEL[:-1] + f",{extra}}}"
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({name}{selector}{RI}))"


def _ratio(hits: str, queries: str) -> str:
    return f"{_rate(hits)} / clamp_min({_rate(queries)}, 1e-9)"


def _quantile(q: float, histogram: str) -> Target:
    expr = f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{SEL}{RI})))"
    return Target(expr, f"p{round(q * 100)}")


PANELS: tuple[Panel, ...] = (
    Panel(
        "Throughput (requests)",
        "reqps",
        "Finished requests per second, by endpoint and HTTP status class.",
        (Target(_rate("mmis_requests_total", "endpoint, status"), "{{endpoint}} {{status}}"),),
    ),
    Panel(
        "Throughput (tokens)",
        "short",
        "Prompt and generated tokens per second.",
        (
            Target(_rate("mmis_prompt_tokens_total"), "prompt"),
            Target(_rate("mmis_generation_tokens_total"), "generated"),
        ),
    ),
    Panel(
        "Request latency",
        "s",
        "End-to-end latency, p50 and p99.",
        (
            _quantile(0.5, "mmis_request_latency_seconds"),
            _quantile(0.99, "mmis_request_latency_seconds"),
        ),
    ),
    Panel(
        "Time to first token",
        "s",
        "TTFT, p50 and p99.",
        (
            _quantile(0.5, "mmis_time_to_first_token_seconds"),
            _quantile(0.99, "mmis_time_to_first_token_seconds"),
        ),
    ),
    Panel(
        "Time per output token",
        "s",
        "Gap between output tokens, p50 and p99.",
        (
            _quantile(0.5, "mmis_time_per_output_token_seconds"),
            _quantile(0.99, "mmis_time_per_output_token_seconds"),
        ),
    ),
    Panel(
        "Cache hit rates",
        "percentunit",
        "Hits / lookups of the P0 processor cache, P1's receiver, encoder and prefix caches.",
        (
            Target(
                _ratio("mmis_processor_cache_hits_total", "mmis_processor_cache_queries_total"),
                "processor (P0)",
            ),
            Target(
                _ratio("mmis_receiver_cache_hits_total", "mmis_receiver_cache_queries_total"),
                "receiver (P1)",
            ),
            Target(
                _ratio("mmis_encoder_cache_hits_total", "mmis_encoder_cache_queries_total"),
                "encoder",
            ),
            Target(
                _ratio("mmis_prefix_cache_hits_total", "mmis_prefix_cache_queries_total"),
                "prefix (tokens)",
            ),
        ),
        max=1.0,
    ),
    Panel(
        "Drift rate",
        "percentunit",
        "Drift misses / shadow hits: per pod over its own window, and over the rate interval.",
        (
            Target(f"max by (pod) (mmis_drift_rate{SEL})", "{{pod}} (window)"),
            Target(_ratio("mmis_drift_misses_total", "mmis_shadow_hits_total"), "all pods"),
        ),
    ),
    Panel(
        "Shadow traffic",
        "ops",
        "Shadow hits, drift misses and shadow invalidations per second.",
        (
            Target(_rate("mmis_shadow_hits_total"), "shadow hits"),
            Target(_rate("mmis_drift_misses_total"), "drift misses"),
            Target(_rate("mmis_shadow_invalidations_total"), "invalidations"),
        ),
    ),
    Panel(
        "Retries by outcome",
        "ops",
        "Re-renders after a miss; 'failed' ended in a 503.",
        (Target(_rate("mmis_mm_retries_total", "endpoint, outcome"), "{{endpoint}} {{outcome}}"),),
    ),
    Panel(
        "Requests waiting / running",
        "short",
        "P1's queue and batch, as the inference gateway sees them.",
        (
            Target(f"sum(mmis:num_requests_waiting{SEL})", "waiting"),
            Target(f"sum(mmis:num_requests_running{SEL})", "running"),
        ),
    ),
    Panel(
        "KV-cache usage",
        "percentunit",
        "Fraction of KV blocks in use, per pod.",
        (Target(f"max by (pod) (mmis:kv_cache_usage_perc{SEL})", "{{pod}}"),),
        max=1.0,
    ),
    Panel(
        "Engines up",
        "short",
        "Pods whose front end gets stats from their engine (mmis_engine_up).",
        (
            Target(f"sum(mmis_engine_up{SEL})", "up"),
            Target(f"count(mmis_engine_up{SEL} == 0) or vector(0)", "down"),
        ),
    ),
)


def _panel(index: int, panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, "min": 0}
    if panel.max is not None:
        defaults["max"] = panel.max
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {
                "refId": chr(ord("A") + n),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": target.expr,
                "legendFormat": target.legend,
            }
            for n, target in enumerate(panel.targets)
        ],
    }


def build() -> dict[str, Any]:
    """The dashboard model Grafana imports."""
    return {
        "uid": UID,
        "title": "mmis",
        "description": "mmis serving: throughput, latency, caches, drift, retries, engine load.",
        "tags": ["mmis", "inference"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                },
                {
                    "name": "model",
                    "label": "Model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(mmis_engine_up, model)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "refresh": 2,
                },
            ]
        },
        "panels": [_panel(i, panel) for i, panel in enumerate(PANELS)],
    }


def render() -> str:
    """The dashboard as the JSON text checked in under ``charts/mmis/dashboards``."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def expressions() -> list[str]:
    """Every PromQL expression of the dashboard, template variables still in place."""
    return [t.expr for p in PANELS for t in p.targets]
