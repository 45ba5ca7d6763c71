"""Real ``mmis engine`` (P1), ``mmis frontend`` (P0) and ``mmis serve`` processes for tests.

Each is a ``tools.Daemon`` (the one process wrapper): output in a log file, terminated by
:meth:`Proc.stop` (SIGTERM, then SIGKILL of its process group after a bound); fixtures call
it in teardown. The front ends announce their address on their first stdout line and their
stdout keeps being drained after it (see ``tools.Daemon``). Waiting for a process to be up
is a bounded wait on an observable condition (that line, then ``/ready``), never a sleep.
The fixtures built on these (a ``mmis serve`` factory, the shared servers, :class:`Launcher`)
are in ``conftest.py``.
"""

from __future__ import annotations

import base64
import io
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import Daemon

from mmis.tiny_models.tiny_model import tiny_model_dir

MMIS = [str(Path(sys.executable).parent / "mmis")]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ONE_ENGINE_THREAD = {"OMP_NUM_THREADS": "1", "MMIS_ENGINE_THREADS": "1"}
# a family's own flags: Qwen2-VL's video limits are test_video's (a 4-frame clip of 2 s, as
# test_epd_e2e sends, is inside them)
VIDEO_MAX_FRAMES = 6
VIDEO_MAX_DURATION_S = 10.0
FAMILY_FLAGS: dict[str, tuple[str, ...]] = {
    "qwen2-vl": (
        *("--video-max-frames", str(VIDEO_MAX_FRAMES)),
        *("--video-max-duration-s", str(VIDEO_MAX_DURATION_S)),
    ),
}


def family_flags(family: str) -> tuple[str, ...]:
    """The ``mmis serve`` flags of ``conftest.family_serve``'s server of ``family``."""
    model = ("--model", str(tiny_model_dir(family)), "--served-model-name", "m")
    return (*model, *FAMILY_FLAGS.get(family, ()))


class Proc(Daemon):
    """``mmis <args>``, offline (never reaches the hub)."""

    prefix = (*MMIS,)
    base_env = OFFLINE


class Engine(Proc):
    def __init__(self, name: str, model: Path, directory: Path, *extra: str) -> None:
        self.input_address = f"ipc://{directory}/p1-in"
        self.output_address = f"ipc://{directory}/p1-out"
        super().__init__(
            name,
            [
                "engine",
                "--model",
                str(model),
                "--input-address",
                self.input_address,
                "--output-address",
                self.output_address,
                "--device",
                "cpu",
                *extra,
            ],
            directory,
        )


class Frontend(Proc):
    def __init__(
        self,
        name: str,
        model: Path,
        engine: Engine,
        log_dir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            name,
            [
                "frontend",
                "--model",
                str(model),
                "--served-model-name",
                "tiny",
                "--port",
                "0",
                "--engine-input-address",
                engine.input_address,
                "--engine-output-address",
                engine.output_address,
                *extra,
            ],
            log_dir,
            env,
            announces=True,
        )
        self.base_url = self.root_url + "/v1"
        key = (env or {}).get("MMIS_FRONTEND_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def wait_ready(self, timeout: float = 180.0) -> None:
        self.wait_http("/ready", timeout)

    def metric(self, name: str) -> float:
        """Sum of every series of ``mmis_frontend_<name>`` on ``/metrics``."""
        answer = httpx.get(self.root_url + "/metrics", headers=self.headers, timeout=30)
        answer.raise_for_status()
        text = answer.text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(f"mmis_frontend_{name}") and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Serve(Proc):
    """``mmis serve --port 0`` on the tiny model, served as ``tiny`` (P0 in it, P1 its child)."""

    def __init__(self, log_dir: Path, *extra: str, env: dict[str, str]) -> None:
        args = ["serve", "--port", "0", "--model", str(tiny_model_dir())]
        args += ["--served-model-name", "tiny", *extra]
        super().__init__("serve", args, log_dir, env, announces=True)


# conftest's ``start_serve``: ``with start_serve(name, *flags, env=..., ready_s=...) as proc``
ServeFactory = Callable[..., AbstractContextManager[Proc]]


def openai_client(proc: Daemon, timeout: float = 120.0, api_key: str = "x") -> openai.OpenAI:
    """The openai SDK on ``proc``'s ``/v1`` (a front end or a serve): no retries."""
    return openai.OpenAI(
        base_url=proc.root_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout
    )


class Launcher:
    """Engines and front ends on the tiny model, logging to ``tmp``; :meth:`close` stops them
    (SIGTERM, bounded) in the reverse order of their start."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tiny_model_dir()
        self.procs: list[Proc] = []

    def engine(self, name: str, *extra: str) -> Engine:
        proc = Engine(name, self.model, self.tmp, *extra)
        self.procs.append(proc)
        return proc

    def frontend(
        self,
        name: str,
        engine: Engine,
        *extra: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Frontend:
        """A front end on ``engine``, waited for (``/ready``) unless ``wait`` is False: front
        ends started one after another without waiting load side by side (each then
        ``wait_ready()``)."""
        proc = Frontend(name, self.model, engine, self.tmp, *extra, env=env)
        self.procs.append(proc)
        if wait:
            proc.wait_ready()
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def series(frontend: Daemon, name: str, **labels: str) -> float:
    """Sum of the samples of catalog series ``name`` on ``/metrics`` having ``labels``."""
    text = httpx.get(frontend.root_url + "/metrics", timeout=30).text
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(w in sample for w in wanted):
            total += float(value)
    return total


def image_url(color: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> str:
    image = Image.new("RGB", size, color)
    image.paste((255 - color[0], 255 - color[1], 255 - color[2]), (0, 0, size[0] // 2, size[1]))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(color: tuple[int, int, int], max_tokens: int = 6) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url(color)}},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
    }


# ---------------------------------------------------------------- /proc helpers (Linux)
def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    """The live (non-zombie) child processes of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_for(what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll ``check`` (another process's state) until true; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.02)  # polling another process's state; not a synchronisation
