"""``mmis encoder``: an encoder-only process (E/PD, issue 46): the model's vision tower and
projector behind a ZMQ ROUTER, answering P0's encode requests from an output cache or by
encoding them (``engine/encoder/``).

Invariants:
- Settings come from one frozen :class:`~mmis.engine.encoder.config.EncoderConfig` (CLI >
  ``MMIS_ENCODER_*`` env > default); the flags are derived from its fields.
- Refused before the model loads, one line ``mmis encoder: ...`` and exit 1: a bad setting;
  an endpoint (the ROUTER's or an event socket's) off loopback without ``--token``
  (``MMIS_ENCODER_TOKEN``). With a token every socket is a ZMQ PLAIN server admitting user
  ``mmis`` with that password only (``engine/event_auth.py``'s ZAP handler).
- A start that fails later (a model that does not load, a dtype the device lacks) also exits 1
  with the cause as the last stderr line.
- Once serving it prints exactly one stdout line, ``mmis encoder: ready on ENDPOINT`` (the
  bound endpoint: a port 0 is replaced by the one chosen), followed by ``health
  http://HOST:PORT`` when ``--health-port`` is set (``mmis serve --encoders`` parses it).
- The key it serves under is ``(--model as given, --revision or "", the resolved dtype)``:
  P0 must ask with the same model string and revision, and P1's dtype.
- SIGTERM/SIGINT end the loop after the batch in hand; the sockets close; exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING, Any

from mmis.config import ConfigError, GiB, add_flags, settings_from_args
from mmis.engine.encoder.config import EncoderConfig
from mmis.entrypoints.common import one_line, resolve_model, served_name, setup_logging

if TYPE_CHECKING:
    from mmis.engine.mm_events import MMEventStream

log = logging.getLogger("mmis.encoder")
PREFIX = "mmis encoder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mmis encoder``'s flags: one per :class:`EncoderConfig` field."""
    add_flags(parser, EncoderConfig)


def config_from_args(args: argparse.Namespace) -> EncoderConfig:
    try:
        return settings_from_args(EncoderConfig, "encoder", args)
    except ConfigError as exc:
        raise SystemExit(f"{PREFIX}: {exc}") from None


def check_endpoints(cfg: EncoderConfig) -> None:
    """Refuse (one line, exit 1) an endpoint off loopback without a token."""
    from mmis.engine.event_auth import is_loopback

    if cfg.token:
        return
    for flag, endpoint in (
        ("--endpoint", cfg.endpoint),
        ("--events-endpoint", cfg.events_endpoint),
        ("--events-replay-endpoint", cfg.events_replay_endpoint),
    ):
        if endpoint and not is_loopback(endpoint):
            raise SystemExit(
                f"{PREFIX}: {flag} {endpoint} is not a loopback address: an encoder reachable "
                "from other hosts needs a token (MMIS_ENCODER_TOKEN; docs/SECURITY.md)"
            )


def _events(cfg: EncoderConfig) -> MMEventStream | None:
    if not cfg.events_endpoint:
        return None
    import zmq

    from mmis.engine.event_publisher import EventPublisher
    from mmis.engine.mm_events import MMEventLog, MMEventStream

    publisher = EventPublisher(
        zmq.Context.instance(), cfg.events_endpoint, cfg.events_replay_endpoint, token=cfg.token
    )
    log.info(
        "output cache events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint
    )
    return MMEventStream(MMEventLog(), publisher, uuid.uuid4().hex)


def _tracing(cfg: EncoderConfig) -> Any:
    from mmis.telemetry.errors import TracingConfigError
    from mmis.telemetry.tracing import setup_tracing
    from mmis.telemetry.tracing_config import TracingConfig

    try:
        config = TracingConfig.from_env(
            otlp_traces_endpoint=cfg.otlp_traces_endpoint,
            service_name=os.environ.get("OTEL_SERVICE_NAME") or "mmis-encoder",
        )
    except TracingConfigError as exc:
        raise SystemExit(f"{PREFIX}: {exc}") from None
    return setup_tracing(config)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    setup_logging(cfg.log_level)
    check_endpoints(cfg)
    tracing = _tracing(cfg)

    import torch

    from mmis.engine.encoder.loader import EncoderStartError, cache_budget, load_vision_only
    from mmis.engine.encoder.output_cache import OutputCache
    from mmis.engine.encoder.server import EncoderServer
    from mmis.protocol.encoder import EncoderKey

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        adapter = load_vision_only(cfg, str(resolve_model(cfg.model)))
    except EncoderStartError as exc:
        raise SystemExit(f"{PREFIX}: {exc}") from None
    except Exception as exc:  # keep the traceback, end on the cause
        log.error("the encoder failed to start", exc_info=True)
        raise SystemExit(f"{PREFIX}: failed to start: {one_line(exc)}") from None
    key = EncoderKey(
        model=cfg.model,
        revision=cfg.revision or "",
        dtype=str(adapter.dtype).removeprefix("torch."),
    )
    budget, chosen_by = cache_budget(cfg)
    log.info("output cache: %.2f GiB (%s); key %s", budget / GiB, chosen_by, key)
    events = _events(cfg)
    cache = OutputCache(budget, events.log if events is not None else None)

    def encode(items: Any) -> list[Any]:
        with torch.inference_mode():
            return adapter.encode_images(items)

    try:
        server = EncoderServer(
            encode,
            key,
            cache,
            endpoint=cfg.endpoint,
            token=cfg.token,
            max_batch_items=cfg.max_batch_items,
            max_message_bytes=cfg.max_message_mb << 20,
            tracing=tracing,
            events=events,
        )
    except Exception as exc:  # the endpoint cannot be bound
        raise SystemExit(f"{PREFIX}: cannot bind {cfg.endpoint}: {one_line(exc)}") from None

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping the encoder", signum)
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    http = None
    if cfg.health_port is not None:
        from mmis.engine.encoder.metrics import encoder_registry
        from mmis.engine.health_server import HealthServer

        registry = encoder_registry(server, served_name(cfg.model, None))
        http = HealthServer(
            "0.0.0.0",
            cfg.health_port,
            lambda: True,
            registry=registry,
            down="the encoder loop died",
            name="encoder",
        ).start()
    ready = f"{PREFIX}: ready on {server.endpoint}"
    if http is not None:
        ready += f" health http://127.0.0.1:{http.port}"
    print(ready, flush=True)
    try:
        server.run()
    finally:
        if http is not None:
            http.close()
        server.close()
        if events is not None:
            events.close()
        tracing.shutdown()
    log.info("encoder stopped: %s", server.counters)
    sys.stdout.flush()
    return 0
