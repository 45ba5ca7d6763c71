"""``tests/tools.in_ci``: the one reading of ``CI`` that decides whether a missing tool fails a
test (in CI) or skips it (on a developer's machine).

- ``CI`` set to ``1``, ``true`` or ``yes`` (any case) is CI; unset, empty, ``0``, ``false`` or
  ``no`` is not.
- No other module under ``tests/`` compares ``CI`` itself: an exact ``== "true"`` once let
  ``CI=1`` skip the shellcheck, user-install and chart-telemetry tests instead of failing them.
  A module that has not moved to :func:`in_ci` yet may only spell out its exact rule.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # tests/tools.py
from tools import in_ci  # noqa: E402

# a read of the CI variable: os.environ.get("CI"...), os.environ["CI"], os.getenv("CI"...)
READ = re.compile(r"""(?:environ\.get|getenv)\(\s*["']CI["']|environ\[\s*["']CI["']\s*\]""")
SAME_RULE = 'os.environ.get("CI", "").lower() in ("1", "true", "yes")'


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


def test_no_test_module_compares_ci_itself() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == TESTS / "tools.py" or path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if READ.search(line) and SAME_RULE not in line:
                offenders.append(f"{path.relative_to(TESTS)}:{number}: {line.strip()}")
    assert not offenders, "read CI through tests/tools.in_ci():\n" + "\n".join(offenders)
