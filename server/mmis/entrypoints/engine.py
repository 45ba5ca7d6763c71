"""``mmis engine``: run P1, the engine core, as a process of its own. It parses the flags
and calls the engine's builder (``engine/builder.py``: model, KV pool, batch limits, wiring).

Invariants:
- Settings come from one frozen :class:`~mmis.engine.config.EngineConfig` (CLI >
  ``MMIS_ENGINE_*`` env > default); the flags are derived from its fields.
- ``cfg.model`` is resolved here (a built-in tiny model's name becomes its directory,
  ``entrypoints/common.py``) and handed to the builder as a path.
- Before the model loads, glibc is told to keep freed memory mapped
  (``engine/execution/host_memory.py``): a step does not fault its activations in anew.
- SIGTERM/SIGINT stop the busy loop; the sockets close; the process exits 0.
- A start that fails (a missing dependency, a model that does not load, a bad setting found
  late: a :class:`~mmis.config.StartupError` such as the builder's
  :class:`~mmis.engine.builder.EngineStartError`, or :func:`check_device`'s) exits 1 at once
  with the cause as the last stderr line, ``mmis engine: ...`` (no traceback; that of an
  unexpected exception is logged before it); with ``--status-file`` that line is written
  there instead (a known cause: ``mmis serve`` relays it as its last line) or also (an
  unexpected one), and ``ready`` once the engine serves (``mmis serve`` reads it: a child
  that never got ready is not restarted, ``entrypoints/serve.py``).
- ``hello`` answers carry the serving dtype and device (P0 shows them in ``/v1/models``).
- With ``--health-port``, ``GET /health`` answers there once the model is loaded
  (``engine/health_server.py``): the engine container's own probe.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
from typing import TYPE_CHECKING, Any

from mmis.config import ConfigError, StartupError, add_flags, settings_from_args
from mmis.engine.builder import build, check_event_endpoints
from mmis.engine.config import EngineConfig
from mmis.entrypoints.common import check_model, one_line, resolve_model, setup_logging

if TYPE_CHECKING:
    from mmis.engine.core_process import EngineCoreProc

log = logging.getLogger("mmis.engine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mmis engine``'s flags: one per :class:`EngineConfig` field."""
    add_flags(parser, EngineConfig)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    try:
        return settings_from_args(EngineConfig, "engine", args)
    except ConfigError as exc:
        raise SystemExit(f"mmis engine: {exc}") from None


def _write_status(path: str | None, text: str) -> bool:
    """Write ``text`` into ``--status-file`` (if set); whether it was written."""
    if path is None:
        return False
    try:
        with open(path, "w") as out:
            out.write(text + "\n")
    except OSError as exc:
        log.warning("cannot write --status-file %s: %s", path, exc)
        return False
    return True


def check_device(device: str | None) -> None:
    """:class:`StartupError` when ``--device`` names CUDA and torch sees no such device here
    (a CPU-only torch, no driver, or an index past the GPUs present)."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU or driver"
        raise StartupError(
            f"--device {device}: torch sees no CUDA device here ({why}): run on a machine "
            "with an NVIDIA GPU, or drop --device (cuda when present, else cpu)"
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise StartupError(
            f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s): pick "
            "cuda:0 to cuda:N-1, or drop the index"
        )


def build_or_exit(cfg: EngineConfig) -> EngineCoreProc:
    """The builder's engine (``engine/builder.py``) for ``cfg``, or exit 1 with the cause as
    one last line (also in ``--status-file``)."""
    try:
        check_model(cfg.model, cfg.revision)
        check_event_endpoints(cfg)  # a settings refusal, before check_device imports torch
        check_device(cfg.device)
        return build(cfg, str(resolve_model(cfg.model)), setup_logging)
    except StartupError as exc:  # the known refusals: one line saying why and the fix
        cause = f"mmis engine: {exc}"
        if _write_status(cfg.status_file, cause):
            raise SystemExit(1) from None  # its reader (mmis serve) says it, once
        raise SystemExit(cause) from None
    except Exception as exc:  # anything else: keep the traceback, end on the cause
        log.error("the engine failed to start", exc_info=True)
        cause = f"mmis engine: failed to start: {one_line(exc)}"
        _write_status(cfg.status_file, cause)
        raise SystemExit(cause) from None


def run(args: argparse.Namespace) -> int:
    from mmis.engine.execution.host_memory import keep_freed_memory

    cfg = config_from_args(args)
    setup_logging(cfg.log_level)
    keep_freed_memory()  # before the model loads: freed step memory stays mapped
    proc = build_or_exit(cfg)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping the engine", signum)
        proc.shutdown()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # the model and libraries are loaded: keep the cyclic GC from re-scanning them at every
    # full collection (pauses of tens of ms in the busy loop otherwise)
    gc.collect()
    gc.freeze()
    health = None
    if cfg.health_port is not None:
        from mmis.engine.health_server import HealthServer

        health = HealthServer("0.0.0.0", cfg.health_port, proc.threads_alive).start()
    _write_status(cfg.status_file, "ready")
    try:
        proc.run()
    finally:
        if health is not None:
            health.close()
        tp = getattr(getattr(proc.core, "runner", None), "tensor_parallel", None)
        if tp is not None:
            tp.shutdown()
        spans = getattr(proc.core, "spans", None)
        if spans is not None:
            spans.close()  # the spans of requests that finished last, before the exporter's exit
    return 0
