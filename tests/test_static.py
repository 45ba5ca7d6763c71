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
    """Incremental where ``MYPY_CACHE_DIR`` (mypy's own variable; ``.ci/run`` keeps one per
    checkout path under ``~/.cache/mmis/mypy``) survives the checkout: mypy reuses a module's
    cached result only when the module's path, size and content hash and its dependencies'
    interfaces are unchanged (a new mtime only makes it re-hash; another path re-checks it),
    and re-reports a cached module's errors, so a type error in a changed file or in an
    unchanged caller of a changed signature still fails."""
    _run("mypy")


def test_import_contracts() -> None:
    _run("lint-imports", "--no-cache")


def test_no_symlinks_in_the_tree() -> None:
    # every module is a real file whose path ends the way its import name does
    proc = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    links = [line for line in proc.stdout.splitlines() if line.startswith("120000")]
    assert links == []


def test_module_paths_end_like_their_import_names() -> None:
    import mmis
    import mmis_operator

    assert Path(mmis.__file__) == ROOT / "server" / "mmis" / "__init__.py"
    assert Path(mmis_operator.__file__) == ROOT / "operator" / "mmis_operator" / "__init__.py"
    import operator  # the standard library's, never a folder of ours

    assert not Path(operator.__file__).is_relative_to(ROOT)
