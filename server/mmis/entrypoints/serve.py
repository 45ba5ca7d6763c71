"""``mmis serve``: P1 and P0 together, the way one pod runs them.

With no arguments it serves the built-in tiny LLaVA (built on first use into the model cache,
``$MMIS_MODEL_CACHE``) as model ``mmis-tiny`` on http://127.0.0.1:8000. It takes every flag of
``mmis frontend`` plus the engine-only flags below.

Invariants:
- P1 runs as a child process (``mmis engine``) on fresh IPC addresses in a private temporary
  directory; P0 runs in this process (``mmis frontend``'s code path, same flags). The first
  stdout line is P0's ``mmis frontend listening on http://HOST:PORT`` (also with ``--port 0``):
  P1's stdout goes to our stderr so it can never come first.
- If P1 exits unexpectedly it is restarted (as a pod's container would be); P0 stays up and
  heals the drift through the cache epoch change. Restarts back off exponentially (1 s to
  30 s); a child that ran for a minute resets the backoff.
- On SIGTERM/SIGINT P0 drains in-flight requests first (uvicorn's graceful shutdown), then P1
  gets SIGTERM (SIGKILL after a bound) and is reaped; the temporary directory is removed; the
  exit status is 0. Signals reach P1 only through us (it runs in its own process group, so a
  terminal's Ctrl-C cannot stop it before P0 has drained). If we die without cleaning up
  (SIGKILL), the kernel sends P1 SIGTERM (Linux parent-death signal): no orphan keeps running.
- Bad engine-only flags exit 2 before anything starts (not through a P1 restart loop).
- P1 gets the model's ``--revision`` too (both sides load the same revision); processor
  kwargs stay in P0, the only side that runs the processor.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from mmis.config import ConfigError
from mmis.entrypoints import frontend
from mmis.entrypoints.common import DEFAULT_MODEL, resolve_model, served_name

log = logging.getLogger("mmis.serve")

# engine-only flags: dest -> (flag, type, help)
_ENGINE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "engine_mm_cache_gb": ("--engine-mm-cache-gb", float, "P1 receiver budget (default: same)"),
    "fault_evict_rate": (
        "--fault-evict-rate",
        float,
        "OPERATOR-ONLY fault injection: P1 evicts this fraction of cached items on purpose",
    ),
    "max_num_seqs": ("--max-num-seqs", int, "most requests running at once in P1"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", int, "tokens per engine step"),
    "kv_cache_gb": ("--kv-cache-gb", float, "KV cache memory in GiB"),
    "num_kv_blocks": ("--num-kv-blocks", int, "KV cache size in blocks (overrides GiB)"),
    "device": ("--device", str, "torch device for P1 (default: cuda if available, else cpu)"),
    "seed": ("--seed", int, "seed of P1's fault-injection random numbers"),
}
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PARENT_PID_ENV = "MMIS_SERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    frontend.add_arguments(parser)
    for dest, (flag, kind, text) in _ENGINE_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    parser.add_argument(
        "--no-prefix-caching", dest="no_prefix_caching", action="store_true", help="disable it"
    )


def engine_command(
    args: argparse.Namespace, model_path: str, in_addr: str, out_addr: str
) -> list[str]:
    """P1's command line: ``mmis engine`` run through :func:`engine_child_main`."""
    launcher = "from mmis.entrypoints.serve import engine_child_main; engine_child_main()"
    cmd = [sys.executable, "-c", launcher, "engine", "--model", model_path]
    cmd += ["--input-address", in_addr, "--output-address", out_addr]
    revision = getattr(args, "revision", None) or os.environ.get("MMIS_FRONTEND_REVISION")
    budget = args.engine_mm_cache_gb if args.engine_mm_cache_gb is not None else args.mm_cache_gb
    pairs = {
        "--revision": revision,
        "--engine-mm-cache-gb": budget,
        "--mm-cache-type": args.mm_cache_type,
        "--shm-dir": args.shm_dir,
        "--fault-evict-rate": args.fault_evict_rate,
        "--max-num-seqs": args.max_num_seqs,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--kv-cache-gb": args.kv_cache_gb,
        "--num-kv-blocks": args.num_kv_blocks,
        "--device": args.device,
        "--seed": args.seed,
        "--max-model-len": args.max_model_len,
        "--log-level": args.log_level,
        "--otlp-traces-endpoint": getattr(args, "otlp_traces_endpoint", None),
    }
    for flag, value in pairs.items():
        if value is not None:
            cmd += [flag, str(value)]
    if args.no_prefix_caching:
        cmd.append("--no-prefix-caching")
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


class EngineSupervisor:
    """Runs P1 as a child and restarts it if it dies while we are serving.

    ``stop`` and a restart never race: spawning happens under the lock and is refused once
    stopping began, so no child can be started after ``stop`` looked at the current one.
    """

    def __init__(
        self, cmd: list[str], *, min_uptime_s: float = 60.0, max_backoff_s: float = 30.0
    ) -> None:
        self.cmd = cmd
        self.min_uptime_s = min_uptime_s
        self.max_backoff_s = max_backoff_s
        self.restarts = 0
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
            log.info("engine started (pid %d)", self.proc.pid)
            return True

    def _watch(self) -> None:
        delay = 1.0
        while self.proc is not None:
            started = time.monotonic()
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started >= self.min_uptime_s:
                delay = 1.0
            log.error("the engine exited with status %s; restarting in %.0fs", code, delay)
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
                log.warning("the engine ignored SIGTERM for %.0fs; killing it", timeout)
                proc.kill()
                proc.wait()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return proc.returncode


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse bad engine-only flags here (exit 2), not through a P1 restart loop."""
    rate = args.fault_evict_rate
    if rate is not None and not 0.0 <= rate <= 1.0:
        raise ConfigError(f"--fault-evict-rate must be within [0, 1], got {rate}")
    for dest in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ConfigError(f"{_ENGINE_FLAGS[dest][0]} must be at least 1, got {value}")
    for dest in ("engine_mm_cache_gb", "kv_cache_gb"):
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ConfigError(f"{_ENGINE_FLAGS[dest][0]} must be positive, got {value}")


def _serve(args: argparse.Namespace) -> int:
    model = args.model or os.environ.get("MMIS_FRONTEND_MODEL") or DEFAULT_MODEL
    log.info("preparing model %s", model)
    path = resolve_model(model)
    args.served_model_name = served_name(model, args.served_model_name)
    args.model = path
    if args.port is None and "MMIS_FRONTEND_PORT" not in os.environ:
        args.port = 8000
    tmp = tempfile.mkdtemp(prefix="mmis-serve-")
    in_addr, out_addr = f"ipc://{tmp}/engine-in", f"ipc://{tmp}/engine-out"
    args.engine_input_address, args.engine_output_address = in_addr, out_addr
    supervisor = EngineSupervisor(engine_command(args, path, in_addr, out_addr))
    try:
        supervisor.start()
        return frontend.run(args)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                signal.signal(sig, _ignore_during_cleanup)
        status = supervisor.stop()
        log.info("engine stopped (status %s, %d restarts)", status, supervisor.restarts)
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_engine_flags(args)
    except ConfigError as exc:
        print(f"mmis serve: {exc}", file=sys.stderr)
        return 2
    main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        {sig: signal.signal(sig, _raise_stop) for sig in _STOP_SIGNALS} if main_thread else {}
    )
    try:
        # uvicorn swaps in its own handlers while it serves, drains on a signal, then restores
        # ours and re-raises the signal: StopRequested is how a drained shutdown ends here
        return _serve(args)
    except StopRequested as stop:
        log.info("%s: P0 drained, P1 stopped", stop)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
