"""``--api-servers N``: N P0 processes behind one port, supervised by a small process.

``mmis frontend --api-servers N`` (and ``mmis serve``'s P0 part) with N above 1 runs
:func:`supervise` instead of one P0: it binds the API socket (and ``--ops-port``) itself,
prints the same lines as one P0 (``mmis frontend listening on http://HOST:PORT`` first, then
``mmis frontend operations on ...``), and starts N children, each a full P0 (its own render
worker, shadow cache, SHM writer of ``--shm-gb / N``, engine client with client index
``--client-index + i``), all accepting on the listening sockets they inherit. With N = 1
none of this runs: one process, exactly as before.

Invariants:
- One shared listening socket, not ``SO_REUSEPORT``: every child calls ``accept`` on the
  same kernel queue, so a connection waits for whichever child is free, and a hung or dead
  child strands none (``SO_REUSEPORT`` hashes each connection to one socket, and the
  connections hashed to a stopped process wait there until they time out). A child accepts
  only once its engine handshake is done (uvicorn listens after the app's start-up), so a
  restarting child takes no connection it cannot serve.
- A child that dies after the group was ready (any child's status said ``ready``) is
  restarted alone, with the same index and client index, after a backoff (1 s doubling to
  30 s per index, reset by a minute of uptime); the exit is logged with its index, pid and
  status and counted (``mmis_frontend_api_server_restarts_total{api_server="i"}`` on
  ``/metrics``). The others keep serving; the requests in flight on the dead one end with
  their connection (the client sees a broken connection and may retry: it lands on a live
  child).
- A child that exits before the group was ever ready (a processor that does not load, an
  engine that never answers) is a failed start: the others are stopped, nothing is
  restarted, and the exit status is 1 with ``mmis frontend: failed to start: ...`` (the
  child's one-line cause) as the last stderr line. Under ``mmis serve`` a P1 that fails to
  start is relayed to every starting child (``engine-failed`` in the run directory), which
  stops waiting for its handshake at once, so serve still exits 1 within seconds.
- SIGTERM/SIGINT is forwarded to every child: each runs its own drain
  (``frontend/api/drain.py``); once all have exited the supervisor exits 0. A second SIGINT
  is forwarded too (the children stop at once). Children run in their own process groups, so
  a terminal's Ctrl-C reaches them only through the supervisor; each holds ``--drain-lock``
  (as does the supervisor) and gets SIGTERM from the kernel if the supervisor dies
  (parent-death signal), so a SIGKILLed supervisor leaves no child serving.
- ``/metrics`` and ``/stats/cache`` answer for all N whichever child accepted the scrape: it
  reads its siblings' figures on their private unix sockets in the supervisor's private run
  directory (mode 0700, removed at exit) and merges them
  (:mod:`mmis.frontend.api.api_server_group`, :mod:`mmis.telemetry.aggregate`): every P0
  series labelled with its process index ``api_server``, P1's figures once, the drift window
  the sum of the N windows. Chosen over Prometheus' multiprocess mode, which cannot carry
  the scrape-time collectors (P1's figures, the drift window, P0's levels), keeps files a
  dead process leaves behind, and cannot sum the drift window; and over one port per process,
  which would change the PodMonitor, the probes and the operator's coherence probe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import FrameType

from mmis.entrypoints import frontend
from mmis.entrypoints.common import one_line, setup_logging
from mmis.frontend.api.api_server_group import READY, UNIX_PATH_MAX, ApiServerGroup, write_text
from mmis.frontend.config import FrontendConfig

log = logging.getLogger("mmis.api_servers")

_PARENT_PID_ENV = "MMIS_API_SERVERS_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LAUNCHER = "from mmis.entrypoints.api_servers import child_main; child_main()"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_STARTING = "starting"
TICK_S = 0.1
"""How often the supervisor looks at its children (exits, readiness, restarts due)."""
MIN_UPTIME_S = 60.0
MAX_BACKOFF_S = 30.0
FAILED_START_GRACE_S = 5.0
"""How long children still starting get to exit on SIGTERM when the group failed to start."""
STOP_MARGIN_S = 10.0
"""Beyond ``--graceful-shutdown-s``: how long a draining child may take before SIGKILL."""


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """What a child reads from its stdin (pickled by its parent): its settings, its place
    in the group and the listening sockets' descriptors it inherited."""

    settings: FrontendConfig
    group: ApiServerGroup
    fds: tuple[int, ...]


def child_settings(settings: FrontendConfig, index: int) -> FrontendConfig:
    """Child ``index``'s settings: its client index, its share of the SHM store."""
    return dataclasses.replace(
        settings,
        client_index=settings.client_index + index,
        shm_gb=settings.shm_gb / settings.api_servers,
    )


def _die_with_parent() -> None:
    """SIGTERM (a drain) when the supervisor dies; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    parent = os.environ.get(_PARENT_PID_ENV)
    if parent is not None and os.getppid() != int(parent):
        sys.exit(0)  # the parent died before the death signal was armed


def child_main() -> None:
    """Entry of one child: die with the supervisor, read the spec, run one P0."""
    _die_with_parent()
    spec: ChildSpec = pickle.load(sys.stdin.buffer)  # from our parent only: its own pipe
    sys.stdin.close()
    setup_logging(spec.settings.log_level)
    sockets = [socket.socket(fileno=fd) for fd in spec.fds]
    group = spec.group
    sys.exit(frontend.serve(spec.settings, group.engine_failed, group=group, sockets=sockets))


class _Child:
    """One index's current process and its restart schedule."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.delay = 1.0
        self.restart_at: float | None = None


class ApiServers:
    """N children on the inherited ``sockets``; :meth:`run` supervises them until a stop
    signal (0) or a failed start (1); :meth:`stop` ends them. Spawns only from the thread
    that calls :meth:`run` (the parent-death signal follows the spawning thread)."""

    def __init__(
        self,
        settings: FrontendConfig,
        sockets: list[socket.socket],
        run_dir: str,
        engine_failed: Callable[[], str | None] | None = None,
    ) -> None:
        self.settings = settings
        self.fds = tuple(s.fileno() for s in sockets)
        self.run_dir = run_dir
        self.engine_failed = engine_failed
        self.count = settings.api_servers
        self.children = [_Child(i) for i in range(self.count)]
        self.restarts = dict.fromkeys(range(self.count), 0)
        self.ever_ready = False
        self.failed_start: str | None = None
        self.stopping = threading.Event()
        self._relayed = False

    def group(self, index: int) -> ApiServerGroup:
        return ApiServerGroup(index, self.count, self.run_dir, parent_pid=os.getpid())

    def spawn(self, child: _Child) -> None:
        group = self.group(child.index)
        group.set_status(child.index, _STARTING)
        spec = ChildSpec(child_settings(self.settings, child.index), group, self.fds)
        env = {**os.environ, _PARENT_PID_ENV: str(os.getpid())}
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=2,  # our stdout carries the address lines only
            pass_fds=self.fds,
            env=env,
            process_group=0,
        )
        stdin = proc.stdin
        if stdin is not None:  # always (stdin=PIPE)
            with contextlib.suppress(BrokenPipeError):  # it died at once: seen as its exit
                stdin.write(pickle.dumps(spec))
            with contextlib.suppress(BrokenPipeError):
                stdin.close()
        child.proc, child.started, child.restart_at = proc, time.monotonic(), None
        log.info("api server %d started (pid %d)", child.index, proc.pid)

    def forward(self, signum: int) -> None:
        """Send ``signum`` to every live child (a stop signal, from the handler)."""
        for child in self.children:
            proc = child.proc
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def _relay_engine_failure(self) -> None:
        if self._relayed or self.engine_failed is None:
            return
        cause = self.engine_failed()
        if cause:
            write_text(self.group(0).engine_failed_path, cause)
            self._relayed = True

    def _exited(self, child: _Child, code: int) -> bool:
        """Handle ``child``'s exit; False when the group failed to start."""
        status = self.group(child.index).status(child.index)
        self.ever_ready = self.ever_ready or status == READY
        pid = child.proc.pid if child.proc is not None else -1
        if not self.ever_ready:
            self.failed_start = (
                status if status and status != _STARTING else f"exited with status {code}"
            )
            log.error(
                "api server %d (pid %d) failed to start: %s", child.index, pid, self.failed_start
            )
            return False
        if time.monotonic() - child.started >= MIN_UPTIME_S:
            child.delay = 1.0
        self.restarts[child.index] += 1
        write_text(self.group(0).restarts_path, _json(self.restarts))
        log.error(
            "api server %d (pid %d) exited with status %s; restarting in %.0fs",
            child.index,
            pid,
            code,
            child.delay,
        )
        child.proc = None
        child.restart_at = time.monotonic() + child.delay
        child.delay = min(child.delay * 2, MAX_BACKOFF_S)
        return True

    def run(self) -> int:
        for child in self.children:
            self.spawn(child)
        while not self.stopping.wait(TICK_S):
            self._relay_engine_failure()
            for child in self.children:
                if not self.ever_ready and child.proc is not None:
                    self.ever_ready = self.group(child.index).status(child.index) == READY
                proc = child.proc
                if proc is not None:
                    code = proc.poll()
                    if code is not None and not self._exited(child, code):
                        return 1
                elif child.restart_at is not None and time.monotonic() >= child.restart_at:
                    self.spawn(child)
        return 0

    def stop(self, timeout: float) -> None:
        """SIGTERM every live child (if not yet), wait up to ``timeout``, SIGKILL the rest."""
        self.stopping.set()
        write_text(self.group(0).stopping_path, "stopping")  # ends start-ups' engine waits
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "api server pid %d did not exit in %.0fs; killing it", proc.pid, timeout
                )
                proc.kill()
                proc.wait()


def _json(counts: dict[int, int]) -> str:
    import json

    return json.dumps({str(k): v for k, v in counts.items()})


def supervise(
    settings: FrontendConfig, engine_failed: Callable[[], str | None] | None = None
) -> int:
    """Run ``settings.api_servers`` P0 processes until a stop signal; the exit status."""
    if settings.drain_lock:
        try:
            frontend.hold_drain_lock(settings.drain_lock)
        except OSError as exc:
            why = one_line(exc)
            print(f"mmis frontend: failed to start: the drain lock: {why}", file=sys.stderr)
            return 1
    run_dir = tempfile.mkdtemp(prefix="mmis-p0-")
    probe = ApiServerGroup(index=0, count=settings.api_servers, run_dir=run_dir)
    if len(probe.socket_path(settings.api_servers - 1)) > UNIX_PATH_MAX:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(
            f"mmis frontend: failed to start: the run directory {run_dir} is too long for a "
            "unix socket (set TMPDIR to a shorter one)",
            file=sys.stderr,
        )
        return 1
    try:
        settings, sockets = frontend.bind(settings)
    except BaseException:  # a port in use (StartupError: mmis.cli says it): nothing left
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    servers = ApiServers(settings, sockets, run_dir, engine_failed)
    main_thread = threading.current_thread() is threading.main_thread()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping %d api servers", signum, servers.count)
        servers.stopping.set()
        servers.forward(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in _STOP_SIGNALS} if main_thread else {}
    code = 1
    try:
        code = servers.run()
    finally:
        grace = settings.graceful_shutdown_s + STOP_MARGIN_S
        servers.stop(grace if servers.ever_ready else FAILED_START_GRACE_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in sockets:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    if servers.failed_start is not None:
        why = servers.failed_start.removeprefix("mmis frontend: failed to start: ")
        print(f"mmis frontend: failed to start: {why}", file=sys.stderr, flush=True)
        return 1
    log.info("api servers stopped (%s restarts)", sum(servers.restarts.values()))
    return code
