"""``mmis frontend``: run P0, the OpenAI-compatible front end of one P1 engine core.

Every flag has an environment equivalent ``MMIS_FRONTEND_<FLAG>`` (dashes as underscores,
e.g. ``MMIS_FRONTEND_ENGINE_INPUT_ADDRESS``); a flag given on the command line wins. Both are
derived from the fields of :class:`~mmis.frontend.config.FrontendConfig`, the one definition.

Invariants:
- ``--port 0`` binds a free port; the bound address is printed as the first stdout line,
  ``mmis frontend listening on http://HOST:PORT``, so a supervisor (or a test) can find it.
  With ``--ops-port`` the second line is ``mmis frontend operations on http://HOST:PORT``
  (``/metrics``, ``/stats/cache``): one server, one app, two sockets; the app tells them
  apart by the port a connection arrived on (:mod:`mmis.frontend.api.http_gate`).
- SIGTERM/SIGINT drain (:mod:`mmis.frontend.api.drain`): from the signal on a new request
  that does work gets a retryable 503 ``server_shutting_down`` (``Retry-After``,
  ``Connection: close``), on any connection; requests in flight run on for up to
  ``--graceful-shutdown-s``, and those still running 1 s before its end are ended by P0 with
  that 503 (a stream: its SSE error event), never cut by uvicorn. Once none is left, uvicorn
  closes its listeners and idle connections, and the lifespan closes the engine client. A
  second SIGINT stops at once. Exit status 0 after a clean shutdown, 2 for bad settings, 1
  when start-up failed (the engine never answered, the processor did not load, the drain
  lock could not be taken): the last stderr line then says why, in one line. A start-up
  error of a known cause (:class:`~mmis.config.StartupError`: a model that is not there, a
  port in use; an engine that failed to start) prints no traceback; under ``mmis serve`` an
  engine that failed to start is said once, by ``mmis serve``.
- With ``--drain-lock FILE`` the process holds a shared ``flock`` on FILE (created if
  missing) from its first moment to its exit, however it exits (the kernel drops it): the
  engine container's preStop, ``mmis wait-frontend --lock FILE``, returns once no front end
  holds it, so P1 outlives every request P0 still serves (docs/SECURITY.md, "Termination in
  order"). Taken before anything else starts, so no request is served without it.
- With ``--api-servers N`` above 1 this process is the supervisor of N P0 processes
  (:mod:`mmis.entrypoints.api_servers`): the same two lines, the same signals and exit
  statuses, every child holding the drain lock too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import fcntl
import gc
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from mmis.config import ConfigError, StartupError, add_flags, settings_from_args
from mmis.entrypoints.common import check_model, one_line, setup_logging
from mmis.frontend.config import FrontendConfig

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from mmis.frontend.api.api_server_group import ApiServerGroup
    from mmis.frontend.api.drain import Drain

UVICORN_BACKSTOP_S = 1
"""uvicorn's own graceful timeout, counted from when the drain left nothing in flight: only
connections still closing are waited for (P0 has ended its requests by then)."""
_held_locks: list[int] = []  # the drain lock's descriptor: open until the process exits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mmis frontend``'s flags: one per :class:`FrontendConfig` field."""
    add_flags(parser, FrontendConfig)


def settings_from(args: argparse.Namespace) -> FrontendConfig:
    """P0's settings from the parsed flags over ``MMIS_FRONTEND_*`` (:class:`ConfigError`)."""
    settings = settings_from_args(FrontendConfig, "frontend", args)
    if not settings.model:
        raise ConfigError("--model (or MMIS_FRONTEND_MODEL) is required")
    _check_tracing(settings)
    return settings


def _check_tracing(settings: FrontendConfig) -> None:
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
    try:
        settings = settings_from(args)
    except ConfigError as exc:
        print(f"mmis frontend: {exc}", file=sys.stderr)
        return 2
    check_model(settings.model, settings.revision)
    setup_logging(settings.log_level)
    return serve(settings)


def hold_drain_lock(path: str) -> None:
    """Take a shared ``flock`` on ``path`` (created if missing) and keep it until the process
    exits: the descriptor is never closed (and not inherited by children)."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a wait-frontend holds it, briefly
    except BaseException:
        os.close(fd)
        raise
    _held_locks.append(fd)


def draining_server(config: uvicorn.Config, drain: Drain) -> uvicorn.Server:
    """uvicorn's server with P0's drain before its own shutdown (uvicorn imported late)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM/SIGINT begins the :class:`Drain` instead of stopping; the server
        stops on the tick at which the drain has nothing left in flight. A later SIGINT
        stops at once (uvicorn's forced exit); a later SIGTERM changes nothing."""

        def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
            super().__init__(config)
            self.drain = drain

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            draining = self.drain.draining
            super().handle_exit(sig, frame)  # records the signal: re-raised after serving
            if draining and sig == signal.SIGINT:
                self.force_exit = True
                return
            self.should_exit = False  # the drain decides (on_tick)
            self.drain.begin()

        async def on_tick(self, counter: int) -> bool:
            stop = await super().on_tick(counter)
            return stop or self.drain.tick()

    return DrainingServer(config, drain)


def _listen(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A listening socket on ``host:port``; :class:`StartupError` naming ``flag`` when it
    cannot be bound (in use, or not an address of this machine)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is in use (another server?): pick another with {flag}"
            ) from None
        raise StartupError(
            f"cannot listen on {host}:{port} ({one_line(exc)}): check --host and {flag}"
        ) from None
    return sock


def check_ports(settings: FrontendConfig) -> None:
    """Bind and release ``--port`` and ``--ops-port`` (unless 0): :class:`StartupError` before
    anything starts when one is taken (``mmis serve``; :func:`bind` says it again if another
    process takes it in between)."""
    for port, flag in ((settings.port, "--port"), (settings.ops_port, "--ops-port")):
        if port:
            _listen(settings.host, port, flag).close()


def _listen_unix(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):  # a dead predecessor's socket file
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen(64)
    return sock


def bind(settings: FrontendConfig) -> tuple[FrontendConfig, list[socket.socket]]:
    """Bind ``--port`` (and ``--ops-port``) and print their lines; the settings with the
    ports bound (``--port 0``, ``--ops-port 0``) and the listening sockets."""
    sock = _listen(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    print(f"mmis frontend listening on http://{host}:{port}", flush=True)
    settings = dataclasses.replace(settings, port=port)
    sockets = [sock]
    if settings.ops_port is not None:
        ops = _listen(settings.host, settings.ops_port, "--ops-port")
        sockets.append(ops)
        ops_port = ops.getsockname()[1]
        settings = dataclasses.replace(settings, ops_port=ops_port)
        print(f"mmis frontend operations on http://{host}:{ops_port}", flush=True)
    return settings, sockets


def _known_start_failure(error: object) -> bool:
    """A start-up error whose message is the whole story (no traceback adds to it)."""
    from mmis.frontend.errors import EngineUnavailableError

    return isinstance(error, StartupError | EngineUnavailableError)


def _quiet_known_start_failure(app: FastAPI) -> ASGIApp:
    """``app`` with starlette's traceback dropped from a lifespan start-up failure of a known
    cause (uvicorn logs that text as is); :func:`serve` prints the one line instead."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def quiet(message: Message) -> None:
            failed = message["type"] == "lifespan.startup.failed"
            if failed and _known_start_failure(getattr(app.state, "startup_error", None)):
                message = {**message, "message": ""}
            await send(message)

        await app(scope, receive, quiet)

    return asgi


def serve(
    settings: FrontendConfig,
    engine_failed: Callable[[], str | None] | None = None,
    *,
    group: ApiServerGroup | None = None,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Bind, announce the address, serve until a signal; the exit status. ``engine_failed``
    (``mmis serve``'s supervisor): why P1 will never answer, so start-up stops waiting.
    ``--api-servers`` above 1: supervise that many processes instead; each of them runs this
    with its ``group`` and the supervisor's listening ``sockets`` (nothing bound or printed)."""
    if group is None and settings.api_servers > 1:
        from mmis.entrypoints.api_servers import supervise

        return supervise(settings, engine_failed)
    import uvicorn

    from mmis.frontend.api.api_server import create_app
    from mmis.frontend.client.media.allocator import keep_image_buffers

    keep_image_buffers()  # glibc keeps a photo's large buffers between requests (issue 45)
    if settings.drain_lock:
        try:
            hold_drain_lock(settings.drain_lock)
        except OSError as exc:
            why = one_line(exc)
            print(f"mmis frontend: failed to start: the drain lock: {why}", file=sys.stderr)
            if group is not None:
                group.set_status(group.index, f"the drain lock: {why}")
            return 1
    if sockets is None:
        settings, sockets = bind(settings)
    on_state: Callable[[object], None] = _freeze_gc
    if group is not None:
        from mmis.frontend.api.api_server_group import READY

        one_of_n = group
        sockets = [*sockets, _listen_unix(group.socket_path(group.index))]

        def on_state(state: object) -> None:
            _freeze_gc(state)
            one_of_n.set_status(one_of_n.index, READY)

    app = create_app(settings, on_state=on_state, engine_failed=engine_failed, group=group)
    config = uvicorn.Config(
        _quiet_known_start_failure(app),
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=UVICORN_BACKSTOP_S,
        lifespan="on",
    )
    server = draining_server(config, app.state.drain)
    # uvicorn re-raises the captured SIGTERM after draining, with the handler that was in
    # place before it started; a no-op one makes a drained shutdown exit with status 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    with contextlib.suppress(SystemExit):  # uvicorn's own exit when the app's start-up failed
        server.run(sockets=sockets)
    if server.started:
        return 0
    error = getattr(app.state, "startup_error", None)
    why = one_line(error) if error is not None else "the server did not start"
    if isinstance(error, StartupError):
        why = str(error)
    if engine_failed is None or not engine_failed():  # else mmis serve says why, once
        print(f"mmis frontend: failed to start: {why}", file=sys.stderr, flush=True)
    if group is not None:
        group.set_status(group.index, why)
    return 1
