"""The operator image's install, replayed: docker/Dockerfile.operator's COPY and ``pip install``
lines run in a fresh venv (no torch, nothing of the server), then the entry point starts.

This is what the image runs, so a missing dependency in operator/pyproject.toml fails here
instead of as a crash-looping operator pod.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile.operator"
IMAGE_VENV = "/opt/mmis"


def _build_stage() -> list[str]:
    """The first (build) stage's instructions, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    stages = re.split(r"^FROM ", text, flags=re.M)
    return [line.strip() for line in stages[1].splitlines()[1:] if line.strip()]


@pytest.mark.slow
def test_operator_image_install_lines_give_a_working_entry_point(tmp_path: Path) -> None:
    image_venv = tmp_path / "opt-mmis"
    workdir = tmp_path / "src"
    workdir.mkdir()
    venv.EnvBuilder(with_pip=True).create(image_venv)
    pip_lines = 0
    for line in _build_stage():
        op, _, rest = line.partition(" ")
        if op == "COPY":
            src, dest = shlex.split(rest)
            shutil.copytree(ROOT / src, workdir / dest, ignore=shutil.ignore_patterns("*.egg-info"))
        elif op == "RUN" and "pip install" in rest:
            cmd = rest.replace(IMAGE_VENV, str(image_venv))
            proc = subprocess.run(cmd, shell=True, cwd=workdir, capture_output=True, text=True)
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            pip_lines += 1
    assert pip_lines >= 1, "no `RUN ... pip install` line found in Dockerfile.operator"

    python = image_venv / "bin" / "python"
    probe = (
        "import importlib.util, sys\n"
        "import mmis_operator.main, mmis_operator.runner, mmis_operator.handlers\n"
        "import mmis_operator.probe, mmis_operator.kube\n"
        "heavy = [m for m in ('torch', 'transformers', 'mmis') if importlib.util.find_spec(m)]\n"
        "sys.exit(f'installed but not needed: {heavy}' if heavy else 0)\n"
    )
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entry = re.search(r'^ENTRYPOINT \["([^"]+)"\]', DOCKERFILE.read_text(), flags=re.M)
    assert entry is not None
    proc = subprocess.run(
        [str(image_venv / "bin" / entry.group(1)), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "--liveness-endpoint" in proc.stdout
    assert sys.executable != str(python)
