"""The observability page's pictures (issue 48 item 2) exist and are not stale.

``scripts/docs-pictures`` records them by hand from a real run (``scripts/docs/pictures.py``);
this checks what a reader sees: every image ``docs/observability.md`` names exists under
``docs/``, is well-formed SVG under 300 KB, and the dashboard picture is titled with every
panel title of ``charts/mmis/dashboards/mmis.json`` (a panel renamed, added or removed since
the recording shows up here: re-run the script), and the trace picture is a chat's trace.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "observability.md"
DASHBOARD = ROOT / "charts" / "mmis" / "dashboards" / "mmis.json"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
SVG_NS = "{http://www.w3.org/2000/svg}"


def _texts(path: Path) -> set[str]:
    """Every text element's full text (its tspans included) in the SVG at ``path``."""
    root = ET.parse(path).getroot()
    assert root.tag == SVG_NS + "svg", path
    return {"".join(t.itertext()) for t in root.iter(SVG_NS + "text")}


def _pictures() -> dict[str, Path]:
    return {Path(ref).name: PAGE.parent / ref for ref in IMAGE.findall(PAGE.read_text())}


def test_the_page_names_pictures_that_exist_small_and_well_formed() -> None:
    pictures = _pictures()
    assert {"dashboard.svg", "trace.svg"} <= pictures.keys(), pictures
    for path in pictures.values():
        assert path.is_file(), f"{path} is named by {PAGE.name} but does not exist"
        assert path.stat().st_size < 300_000, f"{path} is {path.stat().st_size} bytes"
        _texts(path)  # parses as SVG


def test_the_dashboard_picture_shows_every_panel_of_the_dashboard() -> None:
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p.get("targets")}
    assert len(titles) >= 10, titles
    shown = _texts(_pictures()["dashboard.svg"])
    assert titles <= shown, f"stale: run scripts/docs-pictures; missing {sorted(titles - shown)}"


def test_the_trace_picture_is_a_chat_across_frontend_and_engine() -> None:
    shown = " ".join(_texts(_pictures()["trace.svg"]))
    for needle in ("chat tiny", "mmis-frontend", "mmis-engine", "engine_core", "mm_retry"):
        assert needle in shown, needle
