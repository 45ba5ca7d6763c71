"""The observability Go tools (jaeger, prometheus, promtool) and the process wrapper that
tests and benchmarks share.

- :func:`go_tool` finds a binary built by ``scripts/gotools`` in ``$MMIS_TOOLS_DIR/bin``
  (default ``~/.cache/mmis/tools/bin``; never PATH, so a stray binary of another version is
  never used) at its pinned version (``scripts/gotools --check``). When it is missing, the
  test FAILS with the reason under ``CI=true`` and skips with "run scripts/gotools" otherwise.
- :class:`Daemon` is the one process wrapper (Go tools, ``tests/e2e/procs.Proc``, the
  benchmarks' ``ServerProcess``): a session of its own, output in a log file, SIGTERM then
  SIGKILL of its process group. A server that *announces* prints ``listening on URL`` as its
  first stdout line; after that line stdout is copied into the log until EOF by a thread, so
  the server can never stall on a full pipe (uvicorn's access log goes to stdout).
- :class:`Jaeger` runs a Jaeger v2 all-in-one on loopback: OTLP gRPC + HTTP receivers and the
  query API on free ports, in-memory storage, no other listener (its own metrics are off),
  from a config file written into a temporary directory (its self-tracing off, so it never
  dials the default ``localhost:4317``); :meth:`Jaeger.stop` terminates it.

Waiting for a process is a bounded poll of its HTTP API, never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kube"))
from kubecluster.process import free_port as free_port  # noqa: E402 - its one owner

GOTOOLS = ROOT / "scripts" / "gotools"
LISTENING = re.compile(r"listening on (http://\S+)")


def tools_bin() -> Path:
    configured = os.environ.get("MMIS_TOOLS_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "mmis" / "tools"
    return base / "bin"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_tool(name: str) -> str | None:
    """Why ``name`` cannot be used (absent or not at its pinned version), or None."""
    exe = tools_bin() / name
    if not exe.is_file():
        return f"{exe} does not exist"
    check = subprocess.run(
        [str(GOTOOLS), "--check", name], capture_output=True, text=True, check=False
    )
    if check.returncode != 0:
        return check.stderr.strip() or f"scripts/gotools --check {name} failed"
    return None


def go_tool(name: str) -> Path:
    """The path of ``name``; fails (CI=true) or skips the calling test when it is missing."""
    reason = missing_tool(name)
    if reason is None:
        return tools_bin() / name
    message = f"{name} unavailable ({reason}); run scripts/gotools {name}"
    if in_ci():
        pytest.fail(f"with CI=true: {message}", pytrace=False)
    pytest.skip(message)


def wait_until(what: str, check: Callable[[], object], timeout: float, alive: Daemon) -> object:
    """Poll ``check`` until it returns something truthy; fail if ``alive`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if alive.popen.poll() is not None:
            raise RuntimeError(f"{alive.name} exited while waiting for {what}\n{alive.log_tail()}")
        try:
            result = check()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s\n{alive.log_tail()}")
        time.sleep(0.1)  # polling another process's API; not a synchronisation


class Daemon:
    """A process in a session of its own, its output in ``<log_dir>/<name>.log``.

    ``announces``: the process prints ``listening on URL`` first (``mmis serve``, ``mmis
    frontend``); the constructor reads that line into ``root_url`` (``RuntimeError`` with the
    log's tail if it is not that), then keeps draining stdout into the log until EOF.
    Otherwise stdout goes straight to the log and ``root_url`` is for the caller to set.
    A subclass may set ``prefix`` (put before ``cmd``) and ``base_env`` (under ``env``).
    """

    prefix: tuple[str, ...] = ()
    base_env: Mapping[str, str] = {}
    stop_timeout_s = 30.0  # SIGTERM's bound before SIGKILL of the process group

    def __init__(
        self,
        name: str,
        cmd: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        *,
        announces: bool = False,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb", buffering=0)  # noqa: SIM115 - closed in stop()
        self.root_url = ""
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(
            [*self.prefix, *cmd],
            stdout=subprocess.PIPE if announces else self._log,
            stderr=self._log,
            start_new_session=True,
            env={**os.environ, **self.base_env, **(env or {})},
        )
        if announces:
            self._read_address()

    def _read_address(self) -> None:
        stdout = self.popen.stdout
        if stdout is None:
            raise RuntimeError(f"{self.name}: stdout is not a pipe")
        first = stdout.readline()
        match = LISTENING.search(first.decode(errors="replace"))
        if match is None:
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {first!r}\n{self.log_tail()}")
        self._log.write(first)
        self.root_url = match.group(1)
        drain = threading.Thread(
            target=self._drain, args=(stdout,), name=f"{self.name}-stdout", daemon=True
        )
        drain.start()

    def _drain(self, stream: IO[bytes]) -> None:
        """Copy ``stream`` into the log until EOF; once the log is closed, still read it all."""
        for line in iter(stream.readline, b""):
            if not self._log.closed:
                with contextlib.suppress(ValueError):  # closed by stop() just now
                    self._log.write(line)

    def wait_http(self, path: str, timeout: float = 300.0) -> float:
        """Poll ``root_url + path`` until it answers 200; seconds since the process started."""
        url = self.root_url + path

        def answered() -> bool:
            return httpx.get(url, timeout=5).status_code == 200

        wait_until(f"{self.name} {path}", answered, timeout, self)
        return time.monotonic() - self.started_at

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int:
        """Send ``sig``; after ``timeout`` (default ``stop_timeout_s``) SIGKILL the group."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(self.stop_timeout_s if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.popen.returncode

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


JAEGER_CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{otlp_grpc}
      http:
        endpoint: 127.0.0.1:{otlp_http}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


class Jaeger(Daemon):
    """Jaeger v2 all-in-one; ``otlp_grpc`` is the endpoint for ``--otlp-traces-endpoint``."""

    def __init__(self, exe: Path, work_dir: Path) -> None:
        ports = {k: free_port() for k in ("query", "query_grpc", "otlp_grpc", "otlp_http")}
        config = work_dir / "jaeger.yaml"
        config.write_text(JAEGER_CONFIG.format(**ports))
        self.query_url = f"http://127.0.0.1:{ports['query']}"
        self.otlp_grpc = f"http://127.0.0.1:{ports['otlp_grpc']}"
        self.otlp_http = f"http://127.0.0.1:{ports['otlp_http']}/v1/traces"
        cmd = [str(exe), "--config", f"file:{config}"]
        super().__init__("jaeger", cmd, work_dir)

    def wait_ready(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            return httpx.get(self.query_url + "/api/services", timeout=5).status_code == 200

        wait_until("jaeger query API", up, timeout, self)

    @classmethod
    def start(cls, exe: Path, work_dir: Path, attempts: int = 3) -> Jaeger:
        """A ready Jaeger; a port taken between ``free_port`` and Jaeger's bind picks new ones.

        Jaeger needs four ports it cannot choose itself (its config names them), so a port
        that another process of the suite binds in between is a race of the harness, not a
        Jaeger failure: that (and only that, "address already in use") starts over.
        """
        for attempt in range(attempts):
            running = cls(exe, work_dir)
            try:
                running.wait_ready()
                return running
            except RuntimeError:
                running.stop()
                if attempt + 1 == attempts or "address already in use" not in running.log_tail():
                    raise
        raise AssertionError("unreachable")

    def traces(self, service: str) -> list[dict[str, object]]:
        """Every trace of ``service`` in Jaeger's JSON (``/api/traces``), newest first."""
        reply = httpx.get(
            self.query_url + "/api/traces",
            params={"service": service, "limit": 1000, "lookback": "1h"},
            timeout=30,
        )
        reply.raise_for_status()
        data: list[dict[str, object]] = reply.json()["data"] or []
        return data
