"""A probe per container: a stopped engine fails its own probe while the front end's
liveness passes (real ``mmis engine`` and ``mmis frontend`` processes, the tiny model).

The operator points the engine container's probes at ``mmis engine --health-port`` and the
front end's liveness at its ``/health`` (``operator/mmis_operator/builders.py``), so kubelet
restarts the hung container, not the healthy one.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import Engine, Frontend, Proc
from tools import free_port

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]


def _status(url: str) -> int | None:
    """The status of a probe-like GET (kubelet's 2 s timeout); None when nothing answers."""
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_a_stopped_engine_fails_its_probe_while_the_front_end_lives(
    tmp_path: Path, procs: list[Proc]
) -> None:
    model = tiny_model_dir()
    port = free_port()
    engine = Engine("engine", model, tmp_path, "--health-port", str(port))
    procs.append(engine)
    frontend = Frontend("frontend", model, engine, tmp_path)
    procs.append(frontend)
    frontend.wait_ready()
    engine_health = f"http://127.0.0.1:{port}/health"
    assert _status(engine_health) == 200
    assert _status(f"http://127.0.0.1:{port}/other") == 404
    assert _status(frontend.root_url + "/health") == 200

    os.kill(engine.popen.pid, signal.SIGSTOP)  # hung, as far as anyone can tell
    try:
        assert _status(engine_health) is None  # the engine's own probe fails
        deadline = time.monotonic() + 30
        while _status(frontend.root_url + "/ready") == 200:  # P0 sees the hang, bounded
            assert time.monotonic() < deadline, "/ready stayed 200 with the engine stopped"
            time.sleep(0.2)  # polling another process's state; not a synchronisation
        for _ in range(3):  # the front end's liveness passes throughout
            assert _status(frontend.root_url + "/health") == 200
    finally:
        os.kill(engine.popen.pid, signal.SIGCONT)
    assert _status(engine_health) == 200
    frontend.wait_ready(60)  # and the pod is ready again
