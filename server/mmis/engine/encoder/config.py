"""``mmis encoder``'s settings: the one frozen :class:`EncoderConfig`.

Invariants:
- Every setting is one field here (``mmis.config.setting``: one default, one help, a rule);
  the ``mmis encoder`` flags and ``MMIS_ENCODER_<FIELD>`` derive from it (the token is
  ``MMIS_ENCODER_TOKEN``).
- A value that cannot work raises :class:`~mmis.config.ConfigError` naming the flag (never
  quoting the token).
- ``endpoint`` off loopback needs ``token`` (:func:`~mmis.engine.event_auth.is_loopback`'s
  rule): refused at start-up by ``entrypoints/encoder.py``, before the model loads.
"""

from __future__ import annotations

import dataclasses

from mmis.config import AT_LEAST_1, POSITIVE, ConfigError, check, setting, shared
from mmis.engine.config import DEFAULT_MODEL, DTYPE_CHOICES

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5590"
DEFAULT_MAX_BATCH_ITEMS = 16
DEFAULT_MAX_MESSAGE_MB = 512  # a 12.8 MP Qwen2-VL photo is ~300 MB of float32 patches


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    model: str = setting(
        DEFAULT_MODEL,
        metavar="PATH",
        help="model path, hub id or built-in tiny model; P0 must ask with the same string "
        "(it is the model of the encoder's key)",
    )
    revision: str | None = shared("revision")
    dtype: str = setting(
        "auto",
        choices=DTYPE_CHOICES,
        metavar="{" + ",".join(DTYPE_CHOICES) + "}",
        rule=(lambda v: v in DTYPE_CHOICES, f"must be one of {', '.join(DTYPE_CHOICES)}"),
        help="the vision tower's dtype and that of its outputs; auto resolves as P1's --dtype "
        "does (engine/execution/dtype.py): start both with the same value",
    )
    device: str | None = setting(None, help="torch device (default: cuda if available, else cpu)")
    threads: int | None = setting(
        None, rule=POSITIVE, help="torch compute threads (default: torch's own choice)"
    )
    endpoint: str = setting(
        DEFAULT_ENDPOINT,
        metavar="ZMQ_ENDPOINT",
        help="bind the encoder's ZMQ ROUTER here (P0's DEALERs connect); port 0 picks a free "
        "port, printed on the ready line; off loopback it needs --token",
    )
    events_endpoint: str | None = setting(
        None,
        metavar="ZMQ_ENDPOINT",
        help="publish the output cache's stored / evicted events (the multimodal events "
        "format, docs/ROUTING.md) on this ZMQ PUB endpoint; none by default",
    )
    events_replay_endpoint: str | None = setting(
        None,
        metavar="ZMQ_ENDPOINT",
        help="answer replay requests for missed event batches on this ZMQ ROUTER endpoint "
        "(with --events-endpoint); none by default",
    )
    health_port: int | None = setting(
        None,
        rule=(lambda v: v is None or 0 <= v <= 65535, "must be a port number"),
        help="serve GET /health and GET /metrics on this port once the model is loaded; none "
        "by default",
    )
    cache_gb: float | None = setting(
        None,
        rule=POSITIVE,
        help="the output cache's budget in GiB of host memory (default: sized at start-up from "
        "the memory left free once the model is loaded)",
    )
    max_batch_items: int = setting(
        DEFAULT_MAX_BATCH_ITEMS,
        rule=AT_LEAST_1,
        help="items encoded in one vision-tower call at most",
    )
    max_message_mb: int = setting(
        DEFAULT_MAX_MESSAGE_MB,
        rule=AT_LEAST_1,
        help="a request larger than this (MiB, all frames) closes its connection unread",
    )
    token: str | None = setting(
        None,
        metavar="TOKEN",
        help="the password (user 'mmis') every peer of the encoder's sockets must present "
        "(ZMQ PLAIN; docs/SECURITY.md); required off loopback; set it through the environment "
        "(MMIS_ENCODER_TOKEN): a flag shows in the process list",
    )
    otlp_traces_endpoint: str | None = shared("otlp_traces_endpoint")
    log_level: str = shared("log_level")

    def __post_init__(self) -> None:
        check(self)
        if self.token is not None and not 1 <= len(self.token.encode()) <= 255:
            # not a rule: check()'s message would quote the value
            raise ConfigError("--token must be 1 to 255 bytes (a ZMQ PLAIN password)")
