"""The security suite (issue 41): what a client or a pod inside the cluster can reach.

One module per hole that was found by attacking a running mmis: each test failed before its
fix. Every test here carries the ``security`` marker (added below), so
``pytest -m security`` runs exactly this suite; the README's test command runs it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.security)
