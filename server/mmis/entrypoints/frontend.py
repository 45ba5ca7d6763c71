"""``mmis frontend``: run P0, the OpenAI-compatible front end of one P1 engine core.

Every flag has an environment equivalent ``MMIS_FRONTEND_<FLAG>`` (dashes as underscores,
e.g. ``MMIS_FRONTEND_ENGINE_INPUT_ADDRESS``); a flag given on the command line wins. Server
settings live in :class:`~mmis.frontend.state.ServerSettings`, media limits in
:class:`~mmis.frontend.config.FrontendConfig`; both read the same ``frontend`` section.

Invariants:
- ``--port 0`` binds a free port; the bound address is printed as the first stdout line,
  ``mmis frontend listening on http://HOST:PORT``, so a supervisor (or a test) can find it.
- SIGTERM/SIGINT drain: uvicorn stops accepting, waits up to ``--graceful-shutdown-s`` for
  in-flight requests, then the lifespan closes the engine client. Exit status 0 after a clean
  shutdown, 2 for bad settings, 1 when the engine never answered.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from mmis.config import ConfigError, from_env
from mmis.entrypoints.common import PROCESSOR_KWARGS_HELP, REVISION_HELP, json_object_arg

if TYPE_CHECKING:
    from mmis.frontend.config import FrontendConfig
    from mmis.frontend.state import ServerSettings

_SETTINGS_FLAGS: dict[str, tuple[Any, str]] = {
    "model": (str, "model directory or id (processor and config are read from it)"),
    "revision": (str, REVISION_HELP),
    "processor_kwargs": (json_object_arg, PROCESSOR_KWARGS_HELP),
    "served_model_name": (str, "model name shown to clients (default: --model)"),
    "host": (str, "address to bind (default 127.0.0.1)"),
    "port": (int, "port to bind; 0 picks a free one (default 8000)"),
    "engine_input_address": (str, "P1's PULL address, e.g. ipc:///tmp/p1-in"),
    "engine_output_address": (str, "P1's PUB address, e.g. ipc:///tmp/p1-out"),
    "client_index": (int, "this P0's index among the clients of P1 (its output topic)"),
    "mm_cache_type": (str, "multimodal cache transport: lru (inline) or shm"),
    "mm_cache_gb": (float, "shadow cache budget in GiB (must match P1's receiver)"),
    "shm_dir": (str, "directory of the shared-memory store (shm mode)"),
    "shm_gb": (float, "size of the shared-memory store in GiB (shm mode)"),
    "hash_algorithm": (str, "mm_hash algorithm: blake3 or sha256"),
    "api_key": (str, "require 'Authorization: Bearer KEY' on /v1 routes"),
    "max_model_len": (int, "context window (default: from the model config)"),
    "engine_timeout_s": (float, "how long to wait for P1's handshake at startup"),
    "graceful_shutdown_s": (float, "how long SIGTERM waits for in-flight requests"),
    "otlp_traces_endpoint": (
        str,
        "export request spans over OTLP to this endpoint (default: OTEL_* environment, "
        "e.g. OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; tracing is off when none is set)",
    ),
    "drift_window_s": (float, "window of the drift rate on /metrics and /stats/cache"),
    "stats_interval_s": (float, "how often P1's figures are polled for /metrics"),
}
_METAVARS = {"revision": "REV", "processor_kwargs": "JSON"}
# arguments of the processor call that mmis sets itself (ModelProcessor.process_image)
_PROCESSOR_CALL_ARGS = frozenset({"text", "images", "return_tensors"})
_CONFIG_FLAGS = {
    "allowed_local_media_path": (str, "root under which file:// images may be read"),
    "allow_private_media_urls": (bool, "allow image URLs on private/loopback addresses"),
    "media_max_bytes": (int, "largest encoded image in bytes"),
    "media_max_pixels": (int, "largest image in pixels (width * height)"),
    "max_images_per_prompt": (int, "most images in one request"),
    "max_n": (int, "largest accepted n"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, (kind, text) in {**_SETTINGS_FLAGS, **_CONFIG_FLAGS}.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action="store_const", const=True, default=None, help=text)
        else:
            metavar = _METAVARS.get(name)
            parser.add_argument(flag, type=kind, default=None, metavar=metavar, help=text)
    parser.add_argument(
        "--allow-private-media",
        dest="allow_private_media_urls",
        action="store_const",
        const=True,
        default=None,
        help="alias of --allow-private-media-urls",
    )
    parser.add_argument("--log-level", default="info", help="python logging level")


def settings_from(args: argparse.Namespace) -> tuple[ServerSettings, FrontendConfig]:
    from mmis.frontend.config import FrontendConfig
    from mmis.frontend.state import ServerSettings

    given = vars(args)
    settings = from_env(ServerSettings, "frontend", **{k: given.get(k) for k in _SETTINGS_FLAGS})
    config = from_env(FrontendConfig, "frontend", **{k: given.get(k) for k in _CONFIG_FLAGS})
    if not settings.model:
        raise ConfigError("--model (or MMIS_FRONTEND_MODEL) is required")
    if settings.mm_cache_type not in ("lru", "shm"):
        raise ConfigError(f"--mm-cache-type must be lru or shm, got {settings.mm_cache_type!r}")
    reserved = sorted(_PROCESSOR_CALL_ARGS & set(settings.processor_kwargs))
    if reserved:
        raise ConfigError(f"--processor-kwargs must not set {reserved}: mmis passes them itself")
    for name in ("drift_window_s", "stats_interval_s"):
        if not getattr(settings, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    _check_tracing(settings)
    return settings, config


def _check_tracing(settings: ServerSettings) -> None:
    """Fail at start-up (exit 2) on a bad OTLP endpoint or OTEL_* value."""
    from mmis.telemetry.errors import TracingConfigError
    from mmis.telemetry.tracing_config import TracingConfig

    try:
        TracingConfig.from_env(otlp_traces_endpoint=settings.otlp_traces_endpoint)
    except TracingConfigError as exc:
        raise ConfigError(str(exc)) from exc


def _freeze_gc(_state: object) -> None:
    """Once the processor and libraries are loaded, keep them out of every later full GC pass
    (which would otherwise pause the event loop for tens of ms under load)."""
    gc.collect()
    gc.freeze()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings, config = settings_from(args)
    except ConfigError as exc:
        print(f"mmis frontend: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from mmis.frontend.api_server import create_app

    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    print(f"mmis frontend listening on http://{host}:{port}", flush=True)
    app = create_app(settings, config, on_state=_freeze_gc)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=str(args.log_level).lower(),
            timeout_graceful_shutdown=int(settings.graceful_shutdown_s),
            lifespan="on",
        )
    )
    # uvicorn re-raises the captured SIGTERM after draining, with the handler that was in
    # place before it started; a no-op one makes a drained shutdown exit with status 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    return 0 if server.started else 1
