"""A front end SIGKILLed in SHM mode is restarted on the same directory, and it serves.

Real P1 (``mmis engine``) and P0 (``mmis frontend``) processes on the tiny model. In a pod
the ``/dev/shm`` ``emptyDir`` holds one store (plus 10%), so a dead P0's segment left there
would keep the next one from reserving its own. The first P0 dies without unlinking its
segment (SIGKILL, as an OOM kill would); the second reclaims
that segment at start-up (its writer's lock died with it, ``mmis/shm/ownership.py``), serves
the same greedy answer, and P1 drops its mapping of the dead segment, so its memory is freed.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Engine, Frontend, Proc, chat_body

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]


def _segments(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if not p.name.endswith(".key")}


def _answer(frontend: Frontend) -> str:
    client = openai.OpenAI(base_url=frontend.base_url, api_key="x", timeout=120, max_retries=0)
    out = client.chat.completions.create(**chat_body((30, 160, 220), max_tokens=6))
    return out.choices[0].message.content or ""


def test_sigkilled_frontend_restarts_on_the_same_shm_directory(
    tmp_path: Path, procs: list[Proc]
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    model = tiny_model_dir()
    engine = Engine("engine", model, tmp_path, "--mm-cache-type", "shm", "--shm-dir", str(shm))
    procs.append(engine)
    flags = ("--mm-cache-type", "shm", "--shm-dir", str(shm), "--shm-gb", "0.05")
    first = Frontend("frontend-1", model, engine, tmp_path, *flags)
    procs.append(first)
    first.wait_ready()
    before = _answer(first)
    (dead,) = _segments(shm)
    first.stop(signal.SIGKILL)
    assert _segments(shm) == {dead}  # left behind: nobody unlinked it
    maps = Path(f"/proc/{engine.popen.pid}/maps")
    assert dead in maps.read_text()  # P1 still maps it

    second = Frontend("frontend-2", model, engine, tmp_path, *flags)
    procs.append(second)
    second.wait_ready()
    assert _answer(second) == before
    segments = _segments(shm)
    assert dead not in segments and len(segments) == 1, segments
    deadline = time.monotonic() + 30
    while dead in maps.read_text():  # P1's janitor drops the removed segment's mapping
        assert time.monotonic() < deadline, "P1 still maps the reclaimed segment"
        time.sleep(0.1)  # polling another process's state; not a synchronisation
