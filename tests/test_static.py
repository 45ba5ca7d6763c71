"""Static checks run as tests, so the README's one test command covers them.

Each check runs the real tool on the whole tree and fails with its output.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> None:
    tool = BIN / cmd[0]
    exe = str(tool) if tool.exists() else shutil.which(cmd[0])
    if exe is None:
        pytest.fail(f"{cmd[0]} is not installed: pip install -e '.[dev]'")
    proc = subprocess.run([exe, *cmd[1:]], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def test_ruff_lint() -> None:
    _run("ruff", "check", ".")


def test_ruff_format() -> None:
    _run("ruff", "format", "--check", ".")


def test_mypy() -> None:
    _run("mypy")


def test_import_contracts() -> None:
    _run("lint-imports", "--no-cache")


def test_no_top_level_operator_package() -> None:
    # a regular package named `operator` at the root would shadow the standard library
    assert not (ROOT / "operator" / "__init__.py").exists()
    import operator

    assert Path(operator.__file__).parent != ROOT / "operator"
