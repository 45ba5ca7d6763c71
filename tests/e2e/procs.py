"""Real ``mmis engine`` (P1) and ``mmis frontend`` (P0) processes for end-to-end tests.

Every process is started with its output in a log file and is terminated (SIGTERM, then
SIGKILL after a bound) by :meth:`Proc.stop`; fixtures call it in teardown. Waiting for a
process to be up is a bounded wait on an observable condition (the frontend's first stdout
line, then ``/ready``), never a fixed sleep.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

MMIS = [str(Path(sys.executable).parent / "mmis")]
LISTENING = re.compile(r"listening on (http://\S+)")


class Proc:
    def __init__(
        self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        self.popen = subprocess.Popen(
            [*MMIS, *args], stdout=subprocess.PIPE, stderr=self._log, env=env
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


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
        # P1 prints nothing on stdout we need; drain it so it can never block on a full pipe
        assert self.popen.stdout is not None
        threading.Thread(target=self.popen.stdout.read, daemon=True).start()


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
        )
        assert self.popen.stdout is not None
        first = self.popen.stdout.readline().decode()
        match = LISTENING.search(first)
        if match is None:
            self.stop()
            raise RuntimeError(f"{name} did not start: {first!r}\n{self.log_tail()}")
        self.root_url = match.group(1)
        self.base_url = self.root_url + "/v1"
        # keep draining stdout (access logs) so the server can never block on a full pipe
        threading.Thread(target=self._drain, args=(self.popen.stdout,), daemon=True).start()

    def _drain(self, stream: Any) -> None:
        for line in iter(stream.readline, b""):
            if not self._log.closed:
                try:
                    self._log.write(line)
                except ValueError:  # closed by stop() between the check and the write
                    return

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as http:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited\n{self.log_tail()}")
                try:
                    if http.get(self.root_url + "/ready").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)  # polling another process's probe; not a synchronisation
        raise TimeoutError(f"{self.name} not ready after {timeout}s\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        """Sum of every series of ``mmis_frontend_<name>`` on ``/metrics``."""
        text = httpx.get(self.root_url + "/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(f"mmis_frontend_{name}") and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
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
