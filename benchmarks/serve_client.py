"""Shared pieces of the serve-level benchmarks: server processes, images, an async load loop.

- :class:`ServerProcess` is ``tests/tools.Daemon`` (the one process wrapper tests use too):
  logs in a file, stopped with SIGTERM (SIGKILL of its whole process group after a bound), so
  a benchmark never leaves a server behind. ``mmis serve --port 0`` announces its address on
  its first stdout line and its stdout keeps being drained after it; other servers get a free
  port from us and are waited for through an HTTP probe (``wait_http``).
- :func:`run_load` sends every request exactly once with at most ``concurrency`` in flight,
  through ``mmis bench serve``'s loop and client (:mod:`mmis.bench`); each request has its own
  timeout (a hang is counted, never waited out forever). Latency is measured per request from
  just before sending to the full response.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from mmis.bench.serve import run_requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tools import Daemon
from tools import free_port as free_port  # re-exported for the benchmarks

MMIS = str(Path(sys.executable).parent / "mmis")


class ServerProcess(Daemon):
    """One server process; ``root_url`` is where it answers HTTP."""

    stop_timeout_s = 60.0  # a server under load may take a while to drain

    @classmethod
    def mmis_serve(
        cls, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> ServerProcess:
        return cls(name, [MMIS, "serve", "--port", "0", *args], log_dir, env, announces=True)

    def metrics(self) -> dict[str, float]:
        """Every ``mmis_*`` sample on ``/metrics`` (text format), by its full series name."""
        text = httpx.get(self.root_url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("mmis_"):
                series, value = line.rsplit(" ", 1)
                out[series] = float(value)
        return out


def image_data_url(seed: int, size: int = 64) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(model: str, image_url: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": "Describe this image."},
                ],
            }
        ],
    }


@dataclasses.dataclass
class LoadResult:
    wall_s: float
    latencies_s: list[float]
    statuses: Counter[int]
    hangs: int
    errors: Counter[str]
    completion_tokens: int
    outputs: dict[str, set[str]]  # request key -> every distinct completion text seen

    @property
    def ok(self) -> int:
        return sum(n for code, n in self.statuses.items() if 200 <= code < 300)

    @property
    def failed(self) -> int:
        return len(self.latencies_s) - self.ok + self.hangs + sum(self.errors.values())

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1000) if self.latencies_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    def merge(self, other: LoadResult) -> None:
        """Add ``other`` (a later round on the same server) into this result."""
        self.wall_s += other.wall_s
        self.latencies_s += other.latencies_s
        self.statuses.update(other.statuses)
        self.hangs += other.hangs
        self.errors.update(other.errors)
        self.completion_tokens += other.completion_tokens
        for key, outs in other.outputs.items():
            self.outputs.setdefault(key, set()).update(outs)


async def run_load(
    url: str, requests: list[tuple[str, dict[str, Any]]], concurrency: int, timeout: float
) -> LoadResult:
    """POST each ``(key, body)`` to ``url`` once, ``concurrency`` at a time (the closed loop
    of :func:`mmis.bench.serve.run_requests`, the one load loop of ``mmis bench serve``)."""
    outputs, wall = await run_requests(
        url, [body for _, body in requests], max_concurrency=concurrency, timeout=timeout
    )
    result = LoadResult(wall, [], Counter(), 0, Counter(), 0, {})
    for (key, _), out in zip(requests, outputs, strict=True):
        if out.exception == "TimeoutError":  # past the request's own bound
            result.hangs += 1
            continue
        if out.status is None or (out.status == 200 and not out.success):
            # no answer (a transport error), or a 200 that broke off
            result.errors[out.exception or "broken answer"] += 1
            continue
        result.latencies_s.append(out.latency)
        result.statuses[out.status] += 1
        if out.status == 200:
            result.outputs.setdefault(key, set()).add(out.generated_text)
            result.completion_tokens += out.output_tokens
    return result
