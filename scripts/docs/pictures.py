"""The observability page's pictures, made from a real run (issue 48 item 2).

Starts a real Jaeger and a real Prometheus (``scripts/gotools --extras`` builds both), a real
``mmis serve`` on the tiny model exporting its spans to that Jaeger, has Prometheus scrape its
``/metrics`` every second, sends a short mixed load over HTTP (text chats, chats with unique
images, chats repeating four images), then writes:

- ``docs/img/dashboard.svg``: every panel of ``charts/mmis/dashboards/mmis.json``, laid out on
  the dashboard's grid, titled with the panel's title, each of its PromQL queries evaluated by
  Prometheus (``/api/v1/query_range``) over the run, drawn with the panel's legend and unit.
  ``$model`` is ``.*`` and ``$__rate_interval`` is :data:`RATE_INTERVAL`. It is not a Grafana
  screenshot (no Grafana exists here); the queries are the dashboard's own.
- ``docs/img/trace.svg``: one trace read back from Jaeger's query API (``/api/traces``): the
  image chat whose shadow hit P1 had evicted (``--fault-evict-rate``), so it shows the
  ``mm_cache_miss`` / ``mm_cache_invalidation`` / ``mm_retry`` events and the retried engine
  call; a plain image chat when no such trace came. Spans are bars on a time axis (name,
  service, duration), events are marked on their span.

Invariants: the pictures are plain SVG written by this module (no plotting library), with no
timestamps or random ids in them, so a re-run gives equivalent pictures (the figures differ by
the run's timing only); every panel title of the dashboard appears in ``dashboard.svg``
(``tests/test_docs_pictures.py`` checks it). Every process started is stopped on exit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "mmis" / "dashboards" / "mmis.json"
OUT_DIR = ROOT / "docs" / "img"
RATE_INTERVAL = "10s"
STEP_S = 2
SCRAPE_INTERVAL = "1s"
PALETTE = ["#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9"]
SERVICE_COLOURS = {"mmis-frontend": "#1f78c1", "mmis-engine": "#ef843c"}

PROMETHEUS_CONFIG = """\
global:
  scrape_interval: {interval}
  evaluation_interval: {interval}
scrape_configs:
  - job_name: mmis
    metrics_path: /metrics
    static_configs:
      - targets: ["{target}"]
        labels:
          pod: mmis-0
"""


# ---------------------------------------------------------------------------------------------
# the run


def _text_body(n: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Tell me about number {n}."}],
    }


def run_load(base: str, seconds: float, concurrency: int) -> dict[str, int]:
    """A closed-loop mixed load in three equal phases: text, unique images, repeated images.

    Returns the count of answers by status (every request is expected to answer 200).
    """
    import httpx
    from procs import chat_body

    counts: dict[str, int] = {}
    lock = threading.Lock()
    serial = itertools.count()
    start = time.monotonic()
    phase_s = seconds / 3

    def body() -> dict[str, Any]:
        n = next(serial)
        phase = int((time.monotonic() - start) // phase_s)
        if phase == 0:
            return _text_body(n)
        if phase == 1:
            return chat_body((n % 256, (n * 7) % 256, (n * 13) % 256), max_tokens=12)
        return chat_body(((n % 4) * 60, 200, 100), max_tokens=12)

    def worker() -> None:
        with httpx.Client(timeout=120) as http:
            while time.monotonic() - start < seconds:
                reply = http.post(f"{base}/v1/chat/completions", json=body())
                with lock:
                    counts[str(reply.status_code)] = counts.get(str(reply.status_code), 0) + 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


def _events(span: dict[str, Any]) -> list[tuple[int, str]]:
    return [
        (log["timestamp"], field["value"])
        for log in span.get("logs", [])
        for field in log["fields"]
        if field["key"] == "event"
    ]


def pick_trace(traces: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The retried image chat (both services' spans and an ``mm_retry`` event), else the
    image chat with the most spans; None when Jaeger holds no chat."""
    chats = [t for t in traces if any(s["operationName"].startswith("chat") for s in t["spans"])]
    retried = [
        t
        for t in chats
        if any(name == "mm_retry" for s in t["spans"] for _, name in _events(s))
        and len({t["processes"][s["processID"]]["serviceName"] for s in t["spans"]}) == 2
    ]
    pool = retried or chats
    return max(pool, key=lambda t: len(t["spans"])) if pool else None


def record(out_dir: Path, seconds: float, concurrency: int, evict_rate: float) -> None:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]
    from procs import Serve
    from tools import Daemon, Jaeger, free_port, missing_tool, tools_bin, wait_until

    for tool in ("jaeger", "prometheus"):
        why = missing_tool(tool)
        if why is not None:
            raise SystemExit(f"docs-pictures: {why}: run scripts/gotools --extras")
    with tempfile.TemporaryDirectory(prefix="mmis-docs-pictures-") as tmp:
        work = Path(tmp)
        started: list[Daemon] = []
        try:
            jaeger = Jaeger.start(tools_bin() / "jaeger", work)
            started.append(jaeger)
            env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OMP_NUM_THREADS": "1"}
            serve = Serve(
                work,
                "--fault-evict-rate",
                str(evict_rate),
                "--otlp-traces-endpoint",
                jaeger.otlp_grpc,
                env=env,
            )
            started.append(serve)
            serve.wait_http("/ready", 600)
            target = serve.root_url.removeprefix("http://").rstrip("/")
            config = work / "prometheus.yml"
            config.write_text(PROMETHEUS_CONFIG.format(interval=SCRAPE_INTERVAL, target=target))
            port = free_port()
            prom = Daemon(
                "prometheus",
                [
                    str(tools_bin() / "prometheus"),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={work / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                work,
            )
            started.append(prom)
            prom.root_url = f"http://127.0.0.1:{port}"
            prom.wait_http("/-/ready", 60)
            time.sleep(5)  # an idle lead-in: the panels start from the server at rest
            t0 = time.time()
            counts = run_load(serve.root_url, seconds, concurrency)
            print(f"docs-pictures: load done, answers by status {counts}", file=sys.stderr)
            time.sleep(12)  # the tail: the last rates decay, the last scrapes land
            t1 = time.time()
            panels = query_panels(prom.root_url, t0 - 5, t1)
            trace = wait_until(
                "an image chat's trace in jaeger",
                lambda: pick_trace(jaeger.traces("mmis-frontend")),
                60,
                jaeger,
            )
        finally:
            for proc in reversed(started):
                proc.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "dashboard.svg").write_text(render_dashboard(panels, t1 - t0 + 5, evict_rate))
    if not isinstance(trace, dict):  # wait_until returns the check's first truthy answer
        raise SystemExit(f"docs-pictures: no trace from jaeger: {trace!r}")
    (out_dir / "trace.svg").write_text(render_trace(trace))
    print(f"docs-pictures: wrote {out_dir / 'dashboard.svg'} and {out_dir / 'trace.svg'}")


# ---------------------------------------------------------------------------------------------
# the dashboard


def dashboard_panels() -> list[dict[str, Any]]:
    """The dashboard's graph panels in grid order (top to bottom, left to right)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    graphs = [p for p in panels if p.get("targets")]
    return sorted(graphs, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def promql(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", ".*")


def _legend(fmt: str, metric: dict[str, str]) -> str:
    out = fmt
    for key, value in metric.items():
        out = out.replace("{{" + key + "}}", value)
    while "{{" in out:  # a label the series lacks renders empty, as Grafana does
        head, _, rest = out.partition("{{")
        out = head + rest.partition("}}")[2]
    return " ".join(out.split()) or "value"


def query_panels(prom: str, start: float, end: float) -> list[dict[str, Any]]:
    """Each panel with its series: ``[(legend, [(t - start, value), ...]), ...]``."""
    import httpx

    out = []
    for panel in dashboard_panels():
        series: list[tuple[str, list[tuple[float, float]]]] = []
        for target in panel["targets"]:  # in the panel's order; a target's series by legend
            found = []
            reply = httpx.get(
                prom + "/api/v1/query_range",
                params={
                    "query": promql(target["expr"]),
                    "start": start,
                    "end": end,
                    "step": STEP_S,
                },
                timeout=30,
            )
            reply.raise_for_status()
            for result in reply.json()["data"]["result"]:
                points = [
                    (float(t) - start, float(v))
                    for t, v in result["values"]
                    if math.isfinite(float(v))
                ]
                found.append((_legend(target.get("legendFormat", ""), result["metric"]), points))
            series += sorted(found, key=lambda s: s[0])
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        out.append(
            {"title": panel["title"], "gridPos": panel["gridPos"], "unit": unit, "series": series}
        )
    return out


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for m in (1, 2, 4, 5, 8, 10):
        if value <= m * exp:
            return m * exp
    return 10 * exp


def _number(value: float) -> str:
    """Up to four significant digits, no trailing zeros: 0.0025, 12.5, 1875."""
    return f"{value:.4g}" if value < 1e4 else f"{value:.0f}"


def _fmt(value: float, unit: str) -> str:
    if unit == "percentunit":
        return _number(value * 100) + "%"
    if unit == "s":
        return _number(value * 1000) + " ms" if value < 1 else _number(value) + " s"
    return _number(value) + {"reqps": " req/s", "ops": "/s"}.get(unit, "")


def render_dashboard(panels: list[dict[str, Any]], span_s: float, evict_rate: float) -> str:
    """The panels on the dashboard's 24-column grid; one grid unit of height is 30 px."""
    col_px, row_px, top = 40, 32, 44
    width = 24 * col_px
    height = top + max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) * row_px
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="#111217"/>',
        '<text x="10" y="20" fill="#d8d9da" font-size="14">The mmis dashboard\'s PromQL on a '
        "real Prometheus scraping a real mmis serve (tiny model, CPU); not Grafana</text>",
        f'<text x="10" y="36" fill="#8e8e8e">scripts/docs-pictures; '
        f"$__rate_interval = {RATE_INTERVAL}; load: text chats, unique images, then four "
        f"repeated images; P1 evicts {evict_rate:.0%} of its cache (fault injection)</text>",
    ]
    for panel in panels:
        g = panel["gridPos"]
        x, y = g["x"] * col_px + 4, top + g["y"] * row_px + 4
        w, h = g["w"] * col_px - 8, g["h"] * row_px - 8
        parts.append(_panel_svg(panel, x, y, w, h, span_s))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel_svg(panel: dict[str, Any], x: float, y: float, w: float, h: float, span_s: float) -> str:
    nonzero = [s for s in panel["series"] if any(v for _, v in s[1])]
    # Grafana lists every series; a panel of many series at 0 (each endpoint x outcome)
    # lists those it drew above 0 and counts the rest
    series = nonzero if len(panel["series"]) > 6 else panel["series"]
    hidden = len(panel["series"]) - len(series)
    left, right, ptop, legend_h = 62, 12, 28, 18 * (math.ceil(len(series) / 3) + bool(hidden))
    px0, px1 = x + left, x + w - right
    py0, py1 = y + ptop, y + h - 22 - legend_h
    vmax = _nice_max(max((v for _, pts in series for _, v in pts), default=0.0))
    out = [
        f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="#181b1f" stroke="#2c3235"/>',
        f'<text x="{x + 8}" y="{y + 17}" fill="#d8d9da" font-size="13" '
        f'font-weight="bold">{escape(panel["title"])}</text>',
    ]
    for i in range(5):
        v = vmax * i / 4
        yy = py1 - (py1 - py0) * i / 4
        out.append(f'<line x1="{px0}" y1="{yy:.1f}" x2="{px1}" y2="{yy:.1f}" stroke="#2c3235"/>')
        out.append(
            f'<text x="{px0 - 6}" y="{yy + 4:.1f}" fill="#8e8e8e" text-anchor="end">'
            f"{escape(_fmt(v, panel['unit']))}</text>"
        )
    tick = 15 if span_s <= 120 else 30
    for t in range(0, int(span_s) + 1, tick):
        xx = px0 + (px1 - px0) * t / span_s
        out.append(
            f'<text x="{xx:.1f}" y="{py1 + 14}" fill="#8e8e8e" text-anchor="middle">{t} s</text>'
        )
    if not series:
        out.append(
            f'<text x="{(px0 + px1) / 2}" y="{(py0 + py1) / 2}" fill="#8e8e8e" '
            'text-anchor="middle">No data</text>'
        )
    for i, (name, pts) in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        coords = " ".join(
            f"{px0 + (px1 - px0) * t / span_s:.1f},{py1 - (py1 - py0) * v / vmax:.1f}"
            for t, v in pts
        )
        if coords:
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5"/>'
            )
        lx = px0 + (i % 3) * (px1 - px0) / 3
        ly = py1 + 32 + 18 * (i // 3)
        out.append(f'<rect x="{lx:.1f}" y="{ly - 8}" width="12" height="3" fill="{colour}"/>')
        out.append(f'<text x="{lx + 16:.1f}" y="{ly - 3}" fill="#ccccdc">{escape(name)}</text>')
    if hidden:
        ly = py1 + 32 + 18 * math.ceil(len(series) / 3)
        out.append(
            f'<text x="{px0}" y="{ly - 3}" fill="#8e8e8e">and {hidden} more series, '
            "all at 0 throughout</text>"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# the trace


def _trace_story(spans: list[dict[str, Any]]) -> str:
    if any(name == "mm_retry" for s in spans for _, name in _events(s)):
        return (
            "mmis serve with --fault-evict-rate: the repeated image was a shadow hit that P1 had "
            "evicted, so P0 retried the engine call with the image's data"
        )
    return "mmis serve, one image chat"


def render_trace(trace: dict[str, Any]) -> str:
    """Spans in tree order as bars on the trace's time axis; events as marks on their span."""
    spans = trace["spans"]
    service = {s["spanID"]: trace["processes"][s["processID"]]["serviceName"] for s in spans}

    def parent(span: dict[str, Any]) -> str | None:
        refs = [r["spanID"] for r in span.get("references", []) if r["refType"] == "CHILD_OF"]
        return refs[0] if refs else None

    ids = {s["spanID"] for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        up = parent(span)
        children.setdefault(up if up in ids else None, []).append(span)
    ordered: list[tuple[int, dict[str, Any]]] = []

    def walk(up: str | None, depth: int) -> None:
        for span in sorted(
            children.get(up, []), key=lambda s: (s["startTime"], s["operationName"])
        ):
            ordered.append((depth, span))
            walk(span["spanID"], depth + 1)

    walk(None, 0)
    t0 = min(s["startTime"] for s in spans)
    total = max(s["startTime"] + s["duration"] for s in spans) - t0
    label_w, width, row, top = 300, 1100, 30, 56
    bar0, bar1 = label_w, width - 330  # the notes (duration, events) go right of a bar
    height = top + row * len(ordered) + 40
    root = ordered[0][1]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">Trace of one image chat '
        f"({escape(root['operationName'])}), read from Jaeger's query API: "
        f"{len(spans)} spans, {total / 1000:.1f} ms</text>",
        f'<text x="10" y="38" fill="#555">{escape(_trace_story(spans))}; '
        "rendered by scripts/docs-pictures</text>",
    ]
    for i in range(5):
        xx = bar0 + (bar1 - bar0) * i / 4
        out.append(
            f'<line x1="{xx:.1f}" y1="{top - 6}" x2="{xx:.1f}" y2="{height - 30}" '
            'stroke="#e4e4e4"/>'
        )
        out.append(
            f'<text x="{xx:.1f}" y="{height - 14}" fill="#555" text-anchor="middle">'
            f"{total * i / 4 / 1000:.1f} ms</text>"
        )
    for n, (depth, span) in enumerate(ordered):
        yy = top + n * row
        svc = service[span["spanID"]]
        colour = SERVICE_COLOURS.get(svc, "#7eb26d")
        out.append(
            f'<text x="{10 + 14 * depth}" y="{yy + 15}">{escape(span["operationName"])}'
            f'<tspan fill="#888"> {escape(svc)}</tspan></text>'
        )
        x0 = bar0 + (bar1 - bar0) * (span["startTime"] - t0) / total
        bw = max((bar1 - bar0) * span["duration"] / total, 1.5)
        out.append(
            f'<rect x="{x0:.1f}" y="{yy + 4}" width="{bw:.1f}" height="14" fill="{colour}" rx="2"/>'
        )
        names = [name for _, name in _events(span)]
        note = f"{span['duration'] / 1000:.2f} ms" + (f"  ({', '.join(names)})" if names else "")
        out.append(f'<text x="{x0 + bw + 4:.1f}" y="{yy + 15}" fill="#333">{escape(note)}</text>')
        for stamp, _name in _events(span):
            ex = bar0 + (bar1 - bar0) * (stamp - t0) / total
            out.append(
                f'<path d="M{ex:.1f},{yy + 3} l4,8 l-4,8 l-4,-8 z" fill="#e24d42" '
                'stroke="#ffffff" stroke-width="0.8"/>'
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/docs-pictures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where the SVGs go")
    parser.add_argument("--seconds", type=float, default=45.0, help="length of the load")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    parser.add_argument(
        "--fault-evict-rate",
        type=float,
        default=0.5,
        help="mmis serve's --fault-evict-rate: the drift the panels show",
    )
    args = parser.parse_args(argv)
    record(args.out_dir, args.seconds, args.concurrency, args.fault_evict_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
