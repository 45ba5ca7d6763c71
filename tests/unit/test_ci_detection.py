"""``tests/tools.in_ci``: the one reading of ``CI`` that decides whether a missing tool fails a
test (in CI) or skips it (on a developer's machine).

- ``CI`` set to ``1``, ``true`` or ``yes`` (any case) is CI; unset, empty, ``0``, ``false`` or
  ``no`` is not.
- No other module under ``tests/`` reads ``CI`` itself, not even with :func:`in_ci`'s own rule:
  an exact ``== "true"`` once let ``CI=1`` skip the shellcheck, user-install and
  chart-telemetry tests instead of failing them, and copies of the rule drift. The scan is
  checked against the reads it must find (among them the copies that three security and
  routing modules kept) and the writes it must leave alone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # tests/tools.py
from tools import in_ci  # noqa: E402

# a read of the CI variable from any mapping or call: X.get("CI"...), getenv("CI"...),
# X["CI"] (not an assignment to it), "CI" in X
READ = re.compile(
    r"""(?:\.get|getenv)\(\s*["']CI["']"""
    r"""|\[\s*["']CI["']\s*\](?!\s*=[^=])"""
    r"""|["']CI["']\s+(?:not\s+)?in\b"""
)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "yes", "YES"])
def test_ci_is_set(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci()


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", "off"])
def test_ci_is_not_set(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()


@pytest.mark.parametrize(
    "line",
    [
        # the copies tests/kube/test_routing_mmis.py and tests/security/test_rbac.py,
        # test_network_policies.py kept of in_ci's rule
        'return os.environ.get("CI", "").lower() in ("1", "true", "yes")',
        'if os.environ.get("CI", "").lower() in ("1", "true", "yes"):',
        'if os.environ.get("CI") == "true":',
        "ci = os.getenv('CI', '')",
        'if os.environ["CI"] == "1":',
        'if env.get("CI"):',
        'if "CI" in os.environ:',
        "if 'CI' not in env:",
    ],
)
def test_the_scan_finds_a_read(line: str) -> None:
    assert READ.search(line), line


@pytest.mark.parametrize(
    "line",
    [
        'monkeypatch.setenv("CI", value)',
        'monkeypatch.delenv("CI", raising=False)',
        'env["CI"] = "true"',
        'env = {**os.environ, "CI": "1"}',
        'os.environ.get("CIRCLECI")',
    ],
)
def test_the_scan_leaves_writes_alone(line: str) -> None:
    assert not READ.search(line), line


def test_no_test_module_reads_ci_itself() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == TESTS / "tools.py" or path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if READ.search(line):
                offenders.append(f"{path.relative_to(TESTS)}:{number}: {line.strip()}")
    assert not offenders, "read CI through tests/tools.in_ci():\n" + "\n".join(offenders)
