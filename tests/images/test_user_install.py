"""What a user installs holds every runtime dependency: ``pip install .`` with no extras (the
server image's step, docker/Dockerfile.server) into a venv of its own, made by ``.ci/run``
(``MMIS_USER_VENV``; by hand: ``python3 -m venv .venv-user && .venv-user/bin/pip install .``).

- Every module of the checkout's ``mmis`` package is installed there and imports in that
  venv's interpreter, with nothing of this test's environment on its path; the dev extras'
  tools are absent from it (else a dependency they bring in, as ``transformers[serving]``
  brought accelerate, would hide a missing one).
- ``.ci/run`` also serves one image chat with that venv's ``mmis serve``
  (``scripts/smoke-serve``); this file does not start a server again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # tests/tools.py
from tools import in_ci  # noqa: E402

PACKAGE = ROOT / "server" / "mmis"
# distributions the dev extra installs that no runtime module may need
DEV_ONLY = ("pytest", "openai", "ruff", "mypy", "schemathesis", "importlinter")
RUNTIME = ("accelerate", "torch", "transformers", "xgrammar", "av")

PROBE = """
import importlib, importlib.util, json, pkgutil, sys, traceback
import mmis
found = sorted(["mmis", *(m.name for m in pkgutil.walk_packages(mmis.__path__, "mmis."))])
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=3)
print(json.dumps({
    "file": mmis.__file__,
    "found": found,
    "failed": failed,
    "present": {n: importlib.util.find_spec(n) is not None for n in json.loads(sys.argv[2])},
}))
"""


def _user_venv() -> Path:
    venv = Path(os.environ.get("MMIS_USER_VENV") or ROOT / ".venv-user")
    if (venv / "bin" / "python").exists():
        return venv
    how = "python3 -m venv .venv-user && .venv-user/bin/pip install . (what .ci/run does)"
    if in_ci():
        pytest.fail(f"no user-install venv at {venv}; .ci/run builds it: {how}")
    pytest.skip(f"no user-install venv at {venv}; build it with: {how}")


def _checkout_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] != "__main__":  # runs the CLI when imported
            names.append(".".join(parts))
    return names


def test_every_module_imports_with_only_the_runtime_dependencies(tmp_path: Path) -> None:
    venv = _user_venv()
    modules = _checkout_modules()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    proc = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            PROBE,
            json.dumps(modules),
            json.dumps([*DEV_ONLY, *RUNTIME]),
        ],
        cwd=tmp_path,  # not the checkout: its server/ must not shadow the install
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(venv) in report["file"], f"mmis imported from {report['file']}, not the venv"
    missing = sorted(set(modules) - set(report["found"]))
    assert not missing, f"not installed by `pip install .` (or {venv} is stale): {missing}"
    assert not report["failed"], "\n".join(report["failed"].values())
    leaked = [n for n in DEV_ONLY if report["present"][n]]
    assert not leaked, f"dev-only packages in the user venv: {leaked}"
    absent = [n for n in RUNTIME if not report["present"][n]]
    assert not absent, f"runtime dependencies missing from the user venv: {absent}"
