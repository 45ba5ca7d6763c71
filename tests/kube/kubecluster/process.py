"""One control-plane component as a child process, plus free-port allocation.

Invariants:
  * every component runs in its own session (process group); ``stop`` signals the whole
    group (SIGTERM, then SIGKILL after a grace period) and reaps it, so nothing leaks;
  * when started from the main thread, the child also gets PR_SET_PDEATHSIG=SIGKILL, so
    a test runner killed with SIGKILL does not leave an apiserver behind;
  * output goes to ``<log_dir>/<name>.log`` (appended across restarts) and the tail of
    that log is part of every error raised about the component;
  * ports come from binding port 0 on 127.0.0.1, so they are free at the time of asking.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class ComponentError(RuntimeError):
    """A component failed to start, died, or never became healthy."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range
    every outgoing connection's source port comes from: between this probe and the caller's
    own bind, any client in the suite can take it ("address already in use", CI run 49).
    Ports from 10000 up to that range are only ever taken by explicit binds, so a random one
    that binds now stays free unless another caller of this function draws the same number.
    """
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(10000, max(low, 10001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        fallback: int = sock.getsockname()[1]
        return fallback


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Component:
    """A named command line that can be started, health-checked and stopped repeatedly."""

    def __init__(
        self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running():
            raise ComponentError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        in_main = threading.current_thread() is threading.main_thread()
        with self.log_path.open("ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if in_main else None,
                )
            except OSError as exc:
                raise ComponentError(f"cannot start {self.name}: {exc}") from exc

    def stop(self, grace: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # the leader is reaped; make sure no straggler of its group survives either
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready`` until it is true; fail early if the process exits."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise ComponentError(
                    f"{self.name} exited with {self._proc.returncode} before {what}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                raise ComponentError(
                    f"{self.name} not {what} after {timeout:.0f}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(delay)  # polling an external process: there is nothing to wait on
            delay = min(delay * 1.5, 0.5)
