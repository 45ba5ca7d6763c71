"""Static properties of ``scripts/gpu-check`` (the device check), checked without running it.

The script's own dry run (``scripts/gpu-check run --dry-run``) exercises every step on CPU;
these cheap checks keep its plan honest: the steps' limits fit one device call, every step
has a function and a SUMMARY line, the header documents each step with its limit, and the
script parses (and is shellcheck-clean where shellcheck is installed). One step runs for
real: the environment step, as the dry run runs it (``gpu-check _step env`` with
``GPU_CHECK_DRY=1``), must print this torch's attention kernel signatures and the backend
mmis chooses for the 7B shape.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import time
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


def _signature(module: str, name: str) -> str:
    try:
        function = getattr(importlib.import_module(module), name)
    except Exception:
        return "absent"
    return f"{name}{inspect.signature(function)}"


def test_the_env_step_prints_the_kernels_and_the_backend(tmp_path: Path) -> None:
    from mmis.engine.config import EngineConfig

    state = tmp_path / "state"
    state.mkdir()
    (state / "python").write_text(sys.executable)  # what setup leaves for the later steps
    env = dict(
        os.environ,
        GPU_CHECK_DIR=str(tmp_path),
        GPU_CHECK_DRY="1",
        GPU_CHECK_STATE=str(state),
        GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),
        GPU_CHECK_DEADLINE=str(int(time.time()) + 120),
        PYTHONPATH=str(REPO / "server"),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [str(SCRIPT), "_step", "env"], env=env, capture_output=True, text=True, timeout=180
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for module, name in [
        ("torch.nn.attention.varlen", "varlen_attn"),
        ("torch.nn.attention.flex_attention", "flex_attention"),
    ]:
        expected = _signature(module, name)  # this interpreter's torch, as the step's
        line = next(x for x in out.splitlines() if x.startswith(f"{name}: "))
        assert (
            line.startswith(f"{name}: absent")
            if expected == "absent"
            else line == (f"{name}: {expected}")
        )
    block = EngineConfig().block_size
    shape = f"(32 heads, 32 KV heads, head_dim 128, bfloat16, block {block}) on cpu: torch-sdpa"
    assert f"attention for LLaVA-7B {shape} (TorchBackend" in out  # no CUDA here
    assert "  log: attention: torch-sdpa" in out  # the selection's own log
    summary = [x for x in out.splitlines() if x.startswith("SUMMARY env:")]
    assert len(summary) == 1 and summary[0].endswith("attention for the 7B shape: torch-sdpa")
    assert "flex_attention present" in summary[0] or "flex_attention absent" in summary[0]


def test_bench_engine_reads_the_peak_steps_bandwidth(tmp_path: Path) -> None:
    text = body("bench_engine")
    assert '--peak-json "$GPU_CHECK_DIR/peak.json"' in text  # the peak step's figure
    assert '--out "$GPU_CHECK_DIR/bench_engine.json"' in text
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        bench = importlib.import_module("bench_engine_medium")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    peak = tmp_path / "peak.json"
    peak.write_text('{"copy": {"bytes": 2147483648, "gb_per_s": 4321.5}}')
    args = bench.argparse.Namespace(peak_json=peak, device="cpu", threads=1)
    bandwidth, source = bench.device_bandwidth(args)
    assert bandwidth == 4321.5e9 and source.startswith("peak.json: 2048 MiB")
