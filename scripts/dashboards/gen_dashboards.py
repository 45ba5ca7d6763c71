"""Writes (or checks) the generated Grafana dashboard and alert rules in the Helm chart.

``python scripts/dashboards/gen_dashboards.py [--check] --chart DIR`` — what
``scripts/gen-dashboard`` runs. These generators are build tools, not part of the server
package; the metric names they use are those of ``server/mmis/telemetry/catalog.py``
(``tests/telemetry/test_dashboard.py`` checks every expression against it). With
``--check`` nothing is written and the exit status is 1 when a checked-in file differs from a
fresh build (the message names the file and the fix).

Invariant: the checked-in files are exactly :func:`outputs`; hand edits are overwritten.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import mmis_alerts
import mmis_dashboard

DASHBOARD_FILE = "dashboards/mmis.json"
ALERTS_FILE = "dashboards/alerts.yaml"


def outputs() -> dict[str, str]:
    """Chart-relative path -> generated text."""
    return {DASHBOARD_FILE: mmis_dashboard.render(), ALERTS_FILE: mmis_alerts.render()}


def stale(chart: Path) -> list[str]:
    """Chart-relative paths whose checked-in text differs from a fresh build."""
    out = []
    for rel, text in outputs().items():
        path = chart / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(rel)
    return out


def write(chart: Path) -> list[str]:
    """Write every stale file; returns the chart-relative paths written."""
    written = stale(chart)
    texts = outputs()
    for rel in written:
        path = chart / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(texts[rel], encoding="utf-8")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gen-dashboard", description="Regenerate the chart's dashboard and alert rules."
    )
    parser.add_argument("--chart", type=Path, required=True, help="the Helm chart directory")
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if not (args.chart / "Chart.yaml").is_file():
        parser.error(f"{args.chart} is not a Helm chart (no Chart.yaml)")
    if args.check:
        bad = stale(args.chart)
        for rel in bad:
            print(f"{args.chart / rel} is stale: run scripts/gen-dashboard", file=sys.stderr)
        return 1 if bad else 0
    for rel in write(args.chart):
        print(f"wrote {args.chart / rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
