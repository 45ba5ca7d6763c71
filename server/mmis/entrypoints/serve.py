"""``mmis serve``: P1 and P0 together, the way one pod runs them.

With no arguments it serves the built-in tiny LLaVA (built on first use into the model cache,
``$MMIS_MODEL_CACHE``) as model ``mmis-tiny`` on http://127.0.0.1:8000. It takes every flag of
``mmis frontend`` plus each ``mmis engine`` flag the front end lacks (derived from
``EngineConfig``, e.g. ``--engine-mm-cache-gb``, ``--max-num-seqs``), and forwards to P1 the
engine flags given and every shared setting as P0 has it.

Invariants:
- P1 runs as a child process (``mmis engine``) on fresh IPC addresses in a private temporary
  directory; P0 runs in this process (``mmis frontend``'s code path, same flags; with
  ``--api-servers N`` above 1 this process is the supervisor of N P0 children,
  :mod:`mmis.entrypoints.api_servers`, and everything below holds for any N). The first
  stdout line is P0's ``mmis frontend listening on http://HOST:PORT`` (also with ``--port 0``):
  P1's stdout goes to our stderr so it can never come first.
- If P1 exits before it was ever ready (its ``--status-file`` in our temporary directory never
  said ``ready``: a missing dependency, a model that does not load), nothing is restarted:
  P0 stops waiting for its handshake (under N P0s the supervisor relays it to each), and we
  exit 1 within seconds with P1's one-line cause as our last stderr line
  (``mmis serve: the engine failed to start: ...``). A deterministic
  failure retried as a crash would only hide its cause behind minutes of restarts.
- If P1 exits unexpectedly after it was ready it is restarted (as a pod's container would
  be); P0 stays up, sees the loss at once (its socket monitor,
  ``frontend/client/engine_liveness.py``), ends the streams that sent bytes, holds or fails fast the
  other requests (``frontend/client/recovery.py``), reports ``/ready`` false until the new P1
  answers, and heals the drift through the cache epoch change. Restarts back off
  exponentially (1 s to 30 s); a child that ran for a minute resets the backoff.
- A *hung* P1 (alive but silent, e.g. SIGSTOP) is not killed here: P0 takes it as down after
  ``--liveness-timeout-s`` (same handling, ``/ready`` false), and takes it back if it
  answers again (SIGCONT). Killing is the job of the one component that owns P1's liveness:
  in Kubernetes the engine container's liveness probe. This supervisor sees only the process
  exit; a heartbeat gap on a loaded machine is no proof of a hang, and killing a slow engine
  loses every request in it.
- On SIGTERM/SIGINT P0 drains in-flight requests first (uvicorn's graceful shutdown), then P1
  gets SIGTERM (SIGKILL after a bound) and is reaped; the temporary directory is removed; the
  exit status is 0. Signals reach P1 only through us (it runs in its own process group, so a
  terminal's Ctrl-C cannot stop it before P0 has drained). If we die without cleaning up
  (SIGKILL), the kernel sends P1 SIGTERM (Linux parent-death signal): no orphan keeps running.
- Bad settings of either process exit 2 before anything starts (not through a P1 restart
  loop): P1's are checked here by building its ``EngineConfig``.
- A start that cannot work here exits 1 with one line, ``mmis serve: <cause>: <fix>``, and
  no traceback (:class:`~mmis.config.StartupError`). What this process can see is checked
  before any child starts or any port is bound (:func:`preflight`): the model (a path that
  does not exist, a hub id not found or a hub not reachable), a port in use, a ``TMPDIR``
  too long for the IPC sockets' paths, and with ``--mm-cache-type shm`` a ``--shm-dir``
  with less room than ``--shm-gb`` (``mmis frontend`` alone keeps serving with inline
  tensors there instead: a pod never crash-loops on it). What only P1 finds (a device or
  dtype the machine lacks, a model family not supported, a KV cache too small for one
  ``--max-model-len`` request) is P1's one line, relayed as the last line above.
- P1 and the front ends share this machine's CPUs: unless ``--threads``, ``OMP_NUM_THREADS``
  or ``MMIS_ENGINE_THREADS`` size them, P1 runs with the usable CPUs less one per front-end
  process (``mmis/cpus.py``; a torch pool on every core spins between P1's small ops on the
  cores P0's image work needs: benchmarks/README.md, "Where a request's host time goes").
- ``--lora-modules`` or ``--allow-runtime-lora-updating`` turn on P1's ``--enable-lora``
  (vLLM asks for ``--enable-lora`` beside them; here it is implied, and still accepted).
- P1 gets the model's ``--revision`` too (both sides load the same revision); processor
  kwargs stay in P0, the only side that runs the processor.
- ``--encoders N`` (E/PD on one machine, docs/ARCHITECTURE.md "Encoder disaggregation"): N
  ``mmis encoder`` children on loopback ports chosen here (so a restarted one comes back at
  the same address), each supervised like P1 but never a reason to stop serving (P0 falls back
  to sending pixels while one is down), started with the resolved model path, the revision and
  P1's ``--dtype``, and one torch thread each unless ``MMIS_ENCODER_THREADS`` sizes them; P0
  gets their addresses as ``--encoder-urls`` (P1's default threads leave them their CPUs too).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from mmis.config import ConfigError, GiB, StartupError, add_flags, default_of, flag_of, from_env
from mmis.cpus import engine_threads
from mmis.engine.config import EngineConfig
from mmis.entrypoints import frontend
from mmis.entrypoints.common import check_model, resolve_model, served_name, setup_logging
from mmis.frontend.config import FrontendConfig

log = logging.getLogger("mmis.serve")

_ENGINE = "engine_"  # the dest prefix of the engine-only flags
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PARENT_PID_ENV = "MMIS_SERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STATUS_FLAG = flag_of(EngineConfig, "status_file")
_READY = "ready"  # what P1 writes into its status file once it serves


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived outside uvicorn's own handling (or re-raised by it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise StopRequested(signum)


def _ignore_during_cleanup(signum: int, _frame: FrameType | None) -> None:
    log.info("signal %d during shutdown: already stopping", signum)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mmis frontend``'s flags, then each :class:`EngineConfig` option they lack."""
    frontend.add_arguments(parser)
    skip = [*parser._option_string_actions, _STATUS_FLAG]  # the status file is ours to set
    add_flags(parser, EngineConfig, skip=skip, dest_prefix=_ENGINE)
    parser.add_argument(
        "--encoders",
        type=_non_negative,
        metavar="N",
        help="run N `mmis encoder` processes beside P1 (E/PD on one machine): P0 asks them for "
        "the encoder outputs of the images P1 lacks (--encoder-urls set to theirs); default: "
        "none",
    )


def _non_negative(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def frontend_settings(args: argparse.Namespace) -> FrontendConfig:
    """P0's settings; the model defaults to the engine's (P0 alone has none)."""
    if args.model is None and "MMIS_FRONTEND_MODEL" not in os.environ:
        args.model = default_of(EngineConfig, "model")
    return frontend.settings_from(args)


def engine_settings(args: argparse.Namespace, settings: FrontendConfig) -> dict[str, Any]:
    """P1's settings that differ from its child's own environment and defaults: the
    engine-only flags given here, and every shared setting as P0 has it (the two agree)."""
    p0 = {
        f.metadata["shared"]: getattr(settings, f.name)
        for f in dataclasses.fields(FrontendConfig)
        if "shared" in f.metadata
    }
    values: dict[str, Any] = {"model": settings.model}
    for field in dataclasses.fields(EngineConfig):
        given = getattr(args, _ENGINE + field.name, None)
        if given is not None:
            values[field.name] = given
        elif field.metadata.get("shared") in p0:
            values[field.name] = p0[field.metadata["shared"]]
    if settings.lora_modules or settings.allow_runtime_lora_updating:
        values.setdefault("enable_lora", True)  # vLLM wants --enable-lora too: implied here
    if "threads" not in values and not _env_threads():
        # P1, the N front ends and the encoders share these CPUs: leave each of them one
        # (mmis/cpus.py)
        encoders = getattr(args, "encoders", None) or 0
        values["threads"] = engine_threads(settings.api_servers + encoders)
    return values


def _env_threads() -> bool:
    """Whether the environment already sizes P1's threads (it wins over our default)."""
    return bool(os.environ.get("MMIS_ENGINE_THREADS") or os.environ.get("OMP_NUM_THREADS"))


def engine_command(
    args: argparse.Namespace, settings: FrontendConfig, status_file: str | None = None
) -> list[str]:
    """P1's command line: ``mmis engine`` run through :func:`engine_child_main`."""
    launcher = "from mmis.entrypoints.serve import engine_child_main; engine_child_main()"
    cmd = [sys.executable, "-c", launcher, "engine"]
    if status_file is not None:
        cmd += [_STATUS_FLAG, status_file]
    for name, value in engine_settings(args, settings).items():
        flag = flag_of(EngineConfig, name)
        if isinstance(value, bool):
            cmd += [flag] if value != default_of(EngineConfig, name) else []
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


def engine_child_main() -> None:
    """Entry of the P1 child: die with the parent, then run ``mmis`` with our argv."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        parent = os.environ.get(_PARENT_PID_ENV)
        if parent is not None and os.getppid() != int(parent):
            sys.exit(0)  # the parent died before the death signal was armed
    from mmis.cli import main

    sys.exit(main(sys.argv[1:]))


def encoder_command(
    args: argparse.Namespace, settings: FrontendConfig, model: str, endpoint: str
) -> list[str]:
    """One ``mmis encoder`` child's command line (through :func:`engine_child_main`, so it
    dies with us): the resolved ``model``, P0's revision and P1's dtype, so its outputs are
    keyed as P0 asks and shaped as P1 checks them."""
    launcher = "from mmis.entrypoints.serve import engine_child_main; engine_child_main()"
    cmd = [sys.executable, "-c", launcher, "encoder", "--model", model, "--endpoint", endpoint]
    if settings.revision:
        cmd += ["--revision", settings.revision]
    dtype = engine_settings(args, settings).get("dtype")
    if dtype:
        cmd += ["--dtype", str(dtype)]
    if not os.environ.get("MMIS_ENCODER_THREADS"):
        cmd += ["--threads", "1"]
    return cmd


def _loopback_endpoints(n: int) -> list[str]:
    """``n`` free loopback TCP endpoints (chosen once: a restarted encoder binds the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{sock.getsockname()[1]}" for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class EngineSupervisor:
    """Runs P1 (or one encoder: ``name``) as a child and restarts it if it dies while we are
    serving.

    ``stop`` and a restart never race: spawning happens under the lock and is refused once
    stopping began, so no child can be started after ``stop`` looked at the current one.
    With a ``status_file`` (P1's ``--status-file``), a child that exits before any child was
    ever ready is not restarted: :attr:`failed_start` then holds its one-line cause.
    """

    def __init__(
        self,
        cmd: list[str],
        *,
        status_file: str | None = None,
        min_uptime_s: float = 60.0,
        max_backoff_s: float = 30.0,
        name: str = "engine",
    ) -> None:
        self.cmd = cmd
        self.name = name
        self.status_file = status_file
        self.min_uptime_s = min_uptime_s
        self.max_backoff_s = max_backoff_s
        self.restarts = 0
        self.ever_ready = status_file is None  # without a status file: always restart
        self.failed_start: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="mmis-engine-supervisor", daemon=True
        )

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return None if proc is None else proc.pid

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> bool:
        with self._lock:
            if self._stopping.is_set():
                return False
            env = {**os.environ, _PARENT_PID_ENV: str(os.getpid())}
            self.proc = subprocess.Popen(self.cmd, stdout=2, env=env, process_group=0)
            log.info("%s started (pid %d)", self.name, self.proc.pid)
            return True

    def _status(self) -> str:
        try:
            with open(self.status_file or "") as f:
                return f.read().strip()
        except OSError:
            return ""

    def _watch(self) -> None:
        delay = 1.0
        while self.proc is not None:
            started = time.monotonic()
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            status = self._status()
            self.ever_ready = self.ever_ready or status == _READY
            if not self.ever_ready:
                self.failed_start = status or f"exited with status {code} before it was ready"
                return
            if time.monotonic() - started >= self.min_uptime_s:
                delay = 1.0
            log.error("the %s exited with status %s; restarting in %.0fs", self.name, code, delay)
            if self._stopping.wait(delay) or not self._spawn():
                return
            self.restarts += 1
            delay = min(delay * 2, self.max_backoff_s)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the current child, SIGKILL it after ``timeout``; its exit status."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the %s ignored SIGTERM for %.0fs; killing it", self.name, timeout)
                proc.kill()
                proc.wait()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return proc.returncode


def _serve(args: argparse.Namespace, settings: FrontendConfig) -> int:
    tmp = tempfile.mkdtemp(prefix="mmis-serve-")
    settings = dataclasses.replace(
        settings,
        served_model_name=served_name(settings.model, settings.served_model_name),
        engine_input_address=f"ipc://{tmp}/engine-in",
        engine_output_address=f"ipc://{tmp}/engine-out",
    )
    status_file = f"{tmp}/engine-status"
    # P1 resolves the model name itself (a tiny model is built concurrency-safe), so its
    # imports and load overlap ours and a failed start is seen seconds sooner
    supervisor = EngineSupervisor(
        engine_command(args, settings, status_file), status_file=status_file
    )
    encoders: list[EngineSupervisor] = []
    try:
        supervisor.start()
        log.info("preparing model %s", settings.model)
        settings = dataclasses.replace(settings, model=resolve_model(settings.model))
        endpoints = _loopback_endpoints(args.encoders or 0)
        for i, endpoint in enumerate(endpoints):
            encoders.append(
                EngineSupervisor(
                    encoder_command(args, settings, settings.model, endpoint), name=f"encoder {i}"
                )
            )
            encoders[-1].start()
        if endpoints:
            settings = dataclasses.replace(
                settings, encoder_urls=(*settings.encoder_urls, *endpoints)
            )
        code = frontend.serve(settings, engine_failed=lambda: supervisor.failed_start)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                signal.signal(sig, _ignore_during_cleanup)
        for encoder in encoders:
            encoder.stop()
        status = supervisor.stop()
        log.info("engine stopped (status %s, %d restarts)", status, supervisor.restarts)
        shutil.rmtree(tmp, ignore_errors=True)
    if supervisor.failed_start is not None:  # the last line a user sees says why
        cause = supervisor.failed_start.removeprefix("mmis engine: ")
        cause = cause.removeprefix("failed to start: ")
        print(f"mmis serve: the engine failed to start: {cause}", file=sys.stderr, flush=True)
        return 1
    return code


def check_shm(settings: FrontendConfig) -> None:
    """With ``--mm-cache-type shm``: :class:`StartupError` when ``--shm-dir`` is missing or
    has less free room than ``--shm-gb`` (the store would not fit: Docker's default
    ``/dev/shm`` is 64 MiB)."""
    if settings.mm_cache_type != "shm":
        return
    try:
        stat = os.statvfs(settings.shm_dir)
    except OSError as exc:
        raise StartupError(
            f"--shm-dir {settings.shm_dir} cannot be used ({exc.strerror}): point it at a "
            "tmpfs such as /dev/shm, or use --mm-cache-type lru"
        ) from None
    free = stat.f_bavail * stat.f_frsize
    if free < settings.shm_gb * GiB:
        raise StartupError(
            f"{settings.shm_dir} has {free / GiB:.2f} GiB free, too small for --shm-gb "
            f"{settings.shm_gb:g}: enlarge it (docker run --shm-size, a memory emptyDir's "
            "sizeLimit), lower --shm-gb, or use --mm-cache-type lru"
        )


_IPC_NAME = "/mmis-serve-XXXXXXXX/engine-out"  # the longest IPC path _serve makes, less TMPDIR
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, one the terminating NUL


def check_tmpdir() -> None:
    """:class:`StartupError` when the temporary directory is too long a prefix for P1's IPC
    sockets (a unix socket path holds 107 bytes): ZMQ would refuse them after the model
    loaded."""
    tmp = tempfile.gettempdir()
    if len(os.fsencode(tmp + _IPC_NAME)) > _UNIX_PATH_MAX:
        raise StartupError(
            f"the temporary directory {tmp} is too long for the engine's unix sockets "
            f"({_UNIX_PATH_MAX} bytes at most): set TMPDIR to a shorter directory"
        )


def preflight(settings: FrontendConfig) -> None:
    """What makes a start fail that this process can see, checked before any child starts
    (module invariants): :class:`StartupError` with the cause and the fix."""
    check_model(settings.model, settings.revision)
    frontend.check_ports(settings)
    check_shm(settings)
    check_tmpdir()


def run(args: argparse.Namespace) -> int:
    try:  # both processes' settings, checked before anything starts
        settings = frontend_settings(args)
        from_env(EngineConfig, "engine", **engine_settings(args, settings))
    except ConfigError as exc:
        print(f"mmis serve: {exc}", file=sys.stderr)
        return 2
    preflight(settings)  # a StartupError: one line, exit 1 (mmis.cli)
    setup_logging(settings.log_level)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        {sig: signal.signal(sig, _raise_stop) for sig in _STOP_SIGNALS} if main_thread else {}
    )
    try:
        # uvicorn swaps in its own handlers while it serves, drains on a signal, then restores
        # ours and re-raises the signal: StopRequested is how a drained shutdown ends here
        return _serve(args, settings)
    except StopRequested as stop:
        log.info("%s: P0 drained, P1 stopped", stop)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
