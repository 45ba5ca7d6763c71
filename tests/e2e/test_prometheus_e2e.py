"""Every dashboard and alert expression evaluated by a real Prometheus scraping ``mmis serve``.

A real ``mmis serve`` (tiny model, ``--fault-evict-rate 0.3`` so that shadow hits drift and
the retry series exist) is scraped every second by a real Prometheus (``tests/tools.py``
finds the binary) that also loads the chart's alert rules. The scrape adds the
``namespace``/``pod`` labels Kubernetes service discovery would, since the rules group by
them. After the traffic, and once Prometheus has scraped twice more (so every counter has
the two samples a ``rate()`` needs), the test asserts through the HTTP API:

- every PromQL expression of the checked-in dashboard (``charts/mmis/dashboards/mmis.json``,
  with ``$model`` -> the served name and ``$__rate_interval`` -> ``1m``) and of the alert
  rules (``alerts.yaml``) evaluates without error;
- each returns data. An expression holding a filtering comparison (``>``, ``==`` ... without
  ``bool``) or a set operator (``and``/``or``/``unless``) legitimately returns nothing while
  the condition is false (a healthy engine is not down), so for those its data-bearing
  operands are evaluated instead: :func:`data_parts` descends through every node that holds a
  filter down to the largest filter-free sub-expressions, skipping number literals (e.g.
  ``max by (...) (mmis_engine_up) == 0`` -> ``max by (...) (mmis_engine_up)``);
- the dashboard's ``$model`` variable query (``label_values(mmis_engine_up, model)``) finds
  the served model;
- ``/api/v1/rules`` shows the rule group with every rule evaluated and healthy.

Also ``promtool check rules`` passes on the checked-in rule file. Prometheus and serve are
terminated in teardown; waits are bounded polls of Prometheus' API, never sleeps.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from procs import Serve, chat_body
from tools import Daemon, free_port, go_tool, wait_until

CHART = Path(__file__).resolve().parents[2] / "charts" / "mmis" / "dashboards"
DASHBOARD = CHART / "mmis.json"
ALERTS = CHART / "alerts.yaml"
MODEL = "tiny"
RATE_INTERVAL = "1m"
FILTER_OPS = {">", "<", ">=", "<=", "==", "!=", "and", "or", "unless"}
ABSENCE_FUNCS = {"absent", "absent_over_time"}
COLORS = [(40 * i, 255 - 40 * i, 90) for i in range(6)]


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    return [e.replace("$__rate_interval", RATE_INTERVAL).replace("$model", MODEL) for e in exprs]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _children(node: Any) -> list[Any]:
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(
        node,
        promql_parser.AggregateExpr
        | promql_parser.ParenExpr
        | promql_parser.UnaryExpr
        | promql_parser.SubqueryExpr,
    ):
        return [node.expr]
    return []


def _is_filter(node: Any) -> bool:
    if isinstance(node, promql_parser.Call) and node.func.name in ABSENCE_FUNCS:
        return True  # empty exactly when its argument has data
    if not isinstance(node, promql_parser.BinaryExpr) or str(node.op) not in FILTER_OPS:
        return False
    return node.modifier is None or not node.modifier.return_bool


def _holds_filter(node: Any) -> bool:
    return _is_filter(node) or any(_holds_filter(c) for c in _children(node))


def data_parts(expr: str) -> list[str]:
    """The largest filter-free sub-expressions of ``expr`` (``expr`` itself if it has none)."""
    parts: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.NumberLiteral | promql_parser.StringLiteral):
            return
        if not _holds_filter(node):
            parts.append(node.prettify())
            return
        for child in _children(node):
            visit(child)

    visit(promql_parser.parse(expr))
    return parts


def test_data_parts_unwraps_filters_only() -> None:
    assert data_parts("sum(rate(a[1m]))") == ["sum(rate(a[1m]))"]
    assert data_parts("a > bool 1") == ["a > bool 1"]
    assert data_parts("count(a == 0) or vector(0)") == ["a", "vector(0)"]
    assert data_parts("absent(a)") == ["a"]
    assert data_parts("sum by (p) (a) / sum by (p) (b) > 0.05 and sum(c) >= 20") == [
        "sum by (p) (a) / sum by (p) (b)",
        "sum(c)",
    ]


class Prometheus(Daemon):
    def __init__(self, exe: Path, work_dir: Path, target: str) -> None:
        port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": "mmis",
                    "static_configs": [
                        {"targets": [target], "labels": {"namespace": "e2e", "pod": "serve-0"}}
                    ],
                }
            ],
        }
        path = work_dir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            str(exe),
            f"--config.file={path}",
            f"--storage.tsdb.path={work_dir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        super().__init__("prometheus", cmd, work_dir)

    def api(self, path: str, **params: str) -> Any:
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = reply.json()
        if reply.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {reply.status_code} {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def scrapes_after(self, moment: float) -> float | None:
        """The last scrape's wall time if the mmis target is up and scraped after ``moment``."""
        targets = self.api("targets")["activeTargets"]
        if len(targets) != 1 or targets[0]["health"] != "up":
            return None  # not discovered or not scraped yet
        target = targets[0]
        last = datetime.fromisoformat(target["lastScrape"].replace("Z", "+00:00")).timestamp()
        return last if last > moment else None


@pytest.fixture
def tools() -> tuple[Path, Path]:
    return go_tool("prometheus"), go_tool("promtool")


def test_promtool_checks_the_alert_rules(tools: tuple[Path, Path]) -> None:
    check = subprocess.run(
        [str(tools[1]), "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in check.stdout


@pytest.fixture
def scraped(tmp_path: Path, tools: tuple[Path, Path]) -> Iterator[Prometheus]:
    """serve + prometheus, after traffic with drift and two scrapes since it ended."""
    serve = Serve(
        tmp_path, "--fault-evict-rate", "0.3", "--seed", "0", env={"OMP_NUM_THREADS": "1"}
    )
    prometheus: Prometheus | None = None
    try:
        serve.wait_http("/ready", 300)
        prometheus = Prometheus(tools[0], tmp_path, serve.root_url.removeprefix("http://"))
        with httpx.Client(timeout=120) as http:
            for _ in range(4):  # repeats are shadow hits, some evicted on purpose by P1
                for color in COLORS:
                    body = chat_body(color, max_tokens=4)
                    reply = http.post(f"{serve.root_url}/v1/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text
        ended = time.time()
        first = wait_until(
            "a scrape after the traffic", lambda: prometheus.scrapes_after(ended), 60, prometheus
        )
        assert isinstance(first, float)
        wait_until("a second scrape", lambda: prometheus.scrapes_after(first), 60, prometheus)
        yield prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        serve.stop()


def test_every_dashboard_and_alert_expression_returns_data(scraped: Prometheus) -> None:
    prometheus = scraped
    assert prometheus.query('sum(mmis_drift_misses_total{model="tiny"})')[0]["value"][1] != "0"
    empty: list[str] = []
    rules = alert_rules()
    for expr in dashboard_expressions() + [r["expr"] for r in rules]:
        prometheus.query(expr)  # the whole expression: no error (empty is fine when filtered)
        empty += [p for p in data_parts(expr) if not prometheus.query(p)]
    assert not empty, "no data:\n" + "\n".join(empty)

    models = {s["metric"].get("model") for s in prometheus.query("mmis_engine_up")}
    assert models == {MODEL}  # what label_values(mmis_engine_up, model) lists

    def evaluated() -> list[dict[str, Any]] | None:
        groups = prometheus.api("rules", type="alert")["groups"]
        loaded = [r for g in groups for r in g["rules"]]
        return loaded if all(not r["lastEvaluation"].startswith("0001-") for r in loaded) else None

    loaded = wait_until("every rule evaluated", evaluated, 30, prometheus)
    assert isinstance(loaded, list)
    assert sorted(r["name"] for r in loaded) == sorted(r["alert"] for r in rules)
    assert {r["name"]: r["health"] for r in loaded} == {r["alert"]: "ok" for r in rules}
