"""Static properties of ``scripts/gpu-check`` (the device check), checked without running it.

The script's own dry run (``scripts/gpu-check run --dry-run``) exercises every step on CPU;
these cheap checks keep its plan honest: the steps' limits fit one device call, every step
has a function and a SUMMARY line, the header documents each step with its limit, and the
script parses (and is shellcheck-clean where shellcheck is installed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/tools.py
from tools import in_ci

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check"
TEXT = SCRIPT.read_text()
BUDGET_S = 540  # one device call is 600 s at most; the rest is start-up, install and reaping


def steps() -> list[tuple[str, int]]:
    match = re.search(r"^STEPS=\(([^)]*)\)", TEXT, re.M)
    assert match, "no STEPS=(name:limit ...) array"
    return [(name, int(limit)) for name, limit in (s.split(":") for s in match.group(1).split())]


def body(name: str) -> str:
    match = re.search(rf"^step_{name}\(\) \{{\n(.*?)^\}}", TEXT, re.M | re.S)
    assert match, f"no step_{name}() function"
    return match.group(1)


def test_limits_fit_one_device_call() -> None:
    plan = steps()
    assert [name for name, _ in plan][:3] == ["setup", "env", "tests"]
    assert sum(limit for _, limit in plan) <= BUDGET_S


def test_every_step_prints_a_summary() -> None:
    for name, _ in steps():
        text = body(name)
        scripts = re.findall(r"benchmarks/(\w+\.py)", text)
        assert "SUMMARY" in text or scripts, f"step {name}: no SUMMARY line"
        for script in scripts:
            assert "SUMMARY " in (REPO / "benchmarks" / script).read_text(), script
        assert "GPU_CHECK_DRY" in text, f"step {name} has no --dry-run form"


def test_header_documents_each_step_and_limit() -> None:
    header = TEXT.split("\nset -uo pipefail", 1)[0]
    for number, (name, limit) in enumerate(steps(), 1):
        assert f"{number}. {name} ({limit} s)" in header, name
    assert f"add up to {sum(limit for _, limit in steps())} s" in header


def test_script_parses_and_prints_usage() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "run [--dry-run]" in done.stderr


@pytest.mark.skipif(
    shutil.which("shellcheck") is None and not in_ci(),
    reason="shellcheck not installed (scripts/system-deps installs it)",
)
def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.fail("CI is set and no shellcheck: scripts/system-deps installs it")
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
