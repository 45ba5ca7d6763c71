"""The documentation site (issue 48): it builds, its generated references are current, the
README stays a page, and the built site renders in a real browser.

- ``mkdocs build --strict`` (``mkdocs.yml``, ``docs/``) passes into a temporary directory:
  a broken link, anchor, nav entry or page left out of the nav is an error there.
- ``docs/reference/*.md`` equal what ``scripts/gen-docs`` writes now
  (``scripts/docs/gen_docs.py``): a new flag, CRD field or metric fails here until the pages
  are regenerated; :func:`test_a_new_setting_without_regenerating_is_caught` shows it.
- ``README.md`` is at most 100 lines and still holds CI's two commands byte for byte.
- Debian's ``chromium`` opens the built landing page and the CRD reference
  (``--headless --dump-dom``); the rendered DOM has the page's title and a known field.
  Without chromium the check skips saying how to install it, except under ``CI=true``,
  where it fails (``scripts/system-deps`` installs it there).

Relative links and the paths the pages name are checked by ``tests/test_docs_paths.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/tools.py
from tools import in_ci

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[dev]' -e ./operator && .venv/bin/mmis serve"  # noqa: E501
TEST = ".venv/bin/pytest"


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts/docs/gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = build(out)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out


def test_the_site_builds_strict(site: Path) -> None:
    for page in ("index.html", "getting-started.html", "reference/crd.html", "ARCHITECTURE.html"):
        assert (site / page).is_file(), page


def test_the_generated_pages_are_current() -> None:
    stale = _gen_docs().stale()
    assert not stale, f"stale generated pages {[str(p) for p in stale]}: run scripts/gen-docs"


def test_a_new_setting_without_regenerating_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag added to a settings dataclass, pages not regenerated: the CLI page is stale, and
    the page the generator would write names the new flag, its variable and its default."""
    from mmis.config import setting
    from mmis.frontend import config

    @dataclasses.dataclass(frozen=True)
    class WithNewFlag(config.FrontendConfig):
        brand_new_knob: int = setting(7, help="a flag nobody documented")

    monkeypatch.setattr(config, "FrontendConfig", WithNewFlag)
    gen = _gen_docs()
    assert gen.stale() == [gen.OUT / "cli.md"]
    row = next(line for line in gen.cli_page().splitlines() if "--brand-new-knob" in line)
    assert "`MMIS_FRONTEND_BRAND_NEW_KNOB`" in row and "`7`" in row


def test_the_readme_is_a_page_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 100, f"README.md has {len(lines)} lines: move detail into docs/"
    assert INSTALL in lines and TEST in lines  # CI's commands, byte for byte


def _dump_dom(chromium: str, page: Path, tmp_path: Path) -> str:
    proc = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_a_browser_renders_the_landing_page_and_the_crd_reference(
    site: Path, tmp_path: Path
) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        if in_ci():
            pytest.fail("chromium is missing under CI=true: scripts/system-deps installs it")
        pytest.skip("no chromium: `apt-get install chromium` (or scripts/system-deps) to run it")
    index = _dump_dom(chromium, site / "index.html", tmp_path)
    assert "<title>mmis</title>" in index
    assert 'src="architecture.svg"' in index and "Getting started" in index
    crd = _dump_dom(chromium, site / "reference" / "crd.html", tmp_path)
    assert "<title>CRD - mmis</title>" in crd
    assert "spec.model.storage.accessMode" in crd and "MMInferenceService" in crd
