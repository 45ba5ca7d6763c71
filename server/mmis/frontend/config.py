"""P0's settings: the one frozen :class:`FrontendConfig` of ``mmis frontend``.

Invariants:
- Every P0 setting is one field here (``mmis.config.setting``: one default, help, rule); the
  ``mmis frontend`` flags (``--field-name``) and ``MMIS_FRONTEND_<FIELD>`` derive from it;
  what P1 must agree on is ``shared``. A bad value raises :class:`~mmis.config.ConfigError`
  at construction, naming the flag.
- Secure by default: ``file://`` media is disabled (no root) and remote URLs that resolve to
  private, loopback, link-local, multicast or reserved addresses are refused.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections.abc import Mapping
from typing import Any

from mmis.config import NOT_NEGATIVE, POSITIVE, ConfigError, check, setting, shared
from mmis.multimodal.hashing import DEFAULT_ALGORITHM, HASH_ALGORITHMS

MiB = 1 << 20
MAX_API_SERVERS = 64
"""The most P0 processes per engine (``--api-servers``); their metrics' ``api_server`` label
takes the values "0" .. "63" (``mmis.telemetry.catalog.API_SERVER_INDICES``)."""

# Formats PIL may open. Deliberately short: no EPS/PS (Ghostscript), no exotic decoders.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# arguments of the processor call that mmis sets itself (ModelProcessor.process_image and
# process_video)
PROCESSOR_CALL_ARGS = frozenset(
    {"text", "images", "return_tensors", "videos", "video_metadata", "do_sample_frames"}
)


@dataclasses.dataclass(frozen=True)
class FrontendConfig:
    model: str = setting("", help="model directory or id; required (mmis serve: P1's default)")
    revision: str | None = shared("revision")
    processor_kwargs: Mapping[str, Any] = setting(
        factory=dict,
        metavar="JSON",
        rule=(
            lambda v: not PROCESSOR_CALL_ARGS & set(v),
            f"must not set {sorted(PROCESSOR_CALL_ARGS)}: mmis passes them itself",
        ),
        help="JSON object of keyword arguments for the model's processor call, "
        """e.g. '{"do_normalize": false}'; part of every image's mm_hash""",
    )
    served_model_name: str | None = setting(
        None,
        rule=(lambda v: v is None or any(n.strip() for n in v.split(",")), "names no model"),
        help="the model's name(s) in requests, comma-separated aliases; the first one names it "
        "in answers and metrics; a request naming another model is a 404 (default: --model)",
    )
    host: str = setting("127.0.0.1", help="address to bind")
    port: int = setting(8000, help="port to bind; 0 picks a free one")
    api_key: str | None = setting(
        None,
        rule=(lambda v: v is None or any(k.strip() for k in v.split(",")), "names no key"),
        help="require 'Authorization: Bearer KEY' on every route of --port but /health, /ready "
        "and /internal/*; several keys separated by commas, each its own tenant (its uuids "
        "name only its own images)",
    )
    internal_token: str | None = setting(
        None,
        help="the token the /internal/* routes require (/internal/block_keys, "
        "/internal/reset_prefix_cache, /internal/load_lora_adapter, "
        "/internal/unload_lora_adapter; 'Authorization: Bearer TOKEN'; the API key does not "
        "open them); without it they "
        "answer 403. Set it through the environment (MMIS_FRONTEND_INTERNAL_TOKEN): a flag "
        "shows in the process list",
    )
    tenant_header: str | None = setting(
        None,
        metavar="NAME",
        rule=(lambda v: v is None or _is_header_name(v), "must be an HTTP header name"),
        help="the request header naming the client's tenant (whose uuids name only its own "
        "images) instead of its API key; only behind a gateway that authenticates clients "
        "and overwrites this header",
    )
    ops_port: int | None = setting(
        None,
        rule=(lambda v: v is None or 0 <= v <= 65535, "must be a port number (0 picks one)"),
        help="serve /metrics, /stats/cache (no API key: Prometheus and the operator, pod to "
        "pod) and /internal/* (the internal token: routers, the operator) on this port instead "
        "of --port; 0 picks a free one",
    )
    max_request_body_mb: float = setting(
        32.0,
        rule=POSITIVE,
        help="largest request body in MiB (413 beyond it, checked while reading): room for a "
        "full-context prompt and a few 12 MP photos as data URLs",
    )
    graceful_shutdown_s: float = setting(
        30.0,
        rule=NOT_NEGATIVE,
        help="after SIGTERM, how long in-flight requests may still run; new ones get a "
        "retryable 503 (server_shutting_down, Retry-After) at once, and those still running "
        "1 s before the end are ended with it (a stream: an SSE error event); then P0 exits. "
        "The engine's preStop (mmis wait-frontend) must wait longer than this",
    )
    drain_lock: str = setting(
        "",
        metavar="FILE",
        help="hold a shared lock on FILE (created if missing) while this process lives, so "
        "that 'mmis wait-frontend --lock FILE', the engine container's preStop, waits for P0 "
        "to exit; empty: no lock",
    )
    api_servers: int = setting(
        1,
        rule=(lambda v: 1 <= v <= MAX_API_SERVERS, f"must be 1 to {MAX_API_SERVERS}"),
        help="P0 processes serving this engine behind the one --port (and --ops-port): each "
        "has its own render worker, shadow cache, SHM store and engine client (client index "
        "--client-index + i), all accept on one shared listening socket, one that dies is "
        "restarted alone, SIGTERM drains them all; /metrics and /stats/cache answer for all "
        "of them. 1: one process, no supervisor",
    )
    max_model_len: int | None = shared("max_model_len")
    engine_input_address: str = shared("engine_input_address")
    engine_output_address: str = shared("engine_output_address")
    client_index: int = setting(
        0, rule=NOT_NEGATIVE, help="this P0's index among P1's clients (its output topic)"
    )
    engine_timeout_s: float = setting(
        120.0, rule=POSITIVE, help="how long to wait for P1's handshake at start"
    )
    ping_interval_s: float = setting(
        0.5, rule=POSITIVE, help="how often P1 is pinged (its input thread answers)"
    )
    fail_fast: bool = setting(
        False,
        help="while P1 is down or restarting, answer 503 with Retry-After at once instead of "
        "waiting for it (replicas behind a gateway)",
    )
    engine_wait_s: float = setting(
        60.0,
        rule=POSITIVE,
        help="how long a request waits for a restarting P1 before a 503 (without --fail-fast)",
    )
    liveness_timeout_s: float = setting(
        5.0,
        rule=POSITIVE,
        help="P1 counts as hung after this long without a message (a crash is seen at once)",
    )
    mm_cache_type: str = shared("mm_cache_type")
    mm_cache_gb: float = shared("mm_cache_gb")
    shm_dir: str = shared("shm_dir")
    shm_gb: float = setting(
        1.0,
        help="size of the shared-memory store in GiB (shm): the total for all P0 processes "
        "(with --api-servers N each has its own store of --shm-gb / N)",
    )
    hash_algorithm: str = setting(
        DEFAULT_ALGORITHM, choices=HASH_ALGORITHMS, help="mm_hash algorithm"
    )
    otlp_traces_endpoint: str | None = shared("otlp_traces_endpoint")
    drift_window_s: float = setting(
        300.0, rule=POSITIVE, help="window of the drift rate (/metrics, /stats/cache)"
    )
    stats_interval_s: float = setting(
        1.0, rule=POSITIVE, help="how often P1's figures are polled for /metrics"
    )
    log_level: str = shared("log_level")
    allowed_local_media_path: str | None = setting(
        None,
        rule=(lambda v: v != "", "is empty (omit it: no file://)"),
        help="root of readable file:// images",
    )
    allow_private_media_urls: bool = setting(
        False,
        flags=("--allow-private-media-urls", "--allow-private-media"),
        help="allow image URLs on private/loopback/link-local addresses (tests, labs)",
    )
    allowed_media_networks: tuple[str, ...] = setting(
        (),
        rule=(lambda v: all(map(_is_network, v)), "must be CIDRs"),
        help="CIDRs exempt from the SSRF guard",
    )
    media_max_bytes: int = setting(
        20 * MiB, rule=POSITIVE, help="largest encoded image in bytes, any source"
    )
    media_max_pixels: int = setting(
        25_000_000, rule=POSITIVE, help="largest image in pixels (from the header)"
    )
    media_connect_timeout_s: float = setting(
        5.0, rule=POSITIVE, help="connect timeout of an image fetch"
    )
    media_read_timeout_s: float = setting(
        10.0, rule=POSITIVE, help="read timeout of an image fetch"
    )
    media_fetch_timeout_s: float = setting(
        30.0, rule=POSITIVE, help="budget of one image fetch, with redirects"
    )
    media_max_redirects: int = setting(
        5, rule=NOT_NEGATIVE, help="most redirects one image fetch follows"
    )
    max_images_per_prompt: int = setting(8, rule=POSITIVE, help="most images in one request")
    image_formats: tuple[str, ...] = setting(
        DEFAULT_IMAGE_FORMATS,
        rule=(bool, "must name at least one format"),
        help="formats PIL may open",
    )
    max_videos_per_prompt: int = setting(
        1, rule=NOT_NEGATIVE, help="most videos (video_url parts) in one request; 0 refuses video"
    )
    video_fps: float = setting(
        2.0,
        rule=POSITIVE,
        help="frames sampled per second of video (Qwen2-VL's default), evenly over its duration; "
        "fewer when --video-max-frames caps a long clip",
    )
    video_min_frames: int = setting(
        4, rule=POSITIVE, help="fewest frames sampled from a video (all of them if it has fewer)"
    )
    video_max_frames: int = setting(
        32,
        rule=POSITIVE,
        help="most frames sampled from one video: a longer clip is sampled more sparsely",
    )
    video_max_duration_s: float = setting(
        600.0, rule=POSITIVE, help="longest accepted video in seconds (from its header)"
    )
    video_max_frame_pixels: int = setting(
        3840 * 2160,
        rule=POSITIVE,
        help="largest video frame in pixels, width x height (from the stream header)",
    )
    max_n: int = setting(16, rule=POSITIVE, help="largest accepted n (choices per request)")
    generation_config: str = setting(
        "auto",
        choices=("auto", "none"),
        help="auto: the model's generation_config.json sampling values (temperature, top_p, "
        "top_k, min_p, repetition_penalty, max_new_tokens) are the defaults of requests that "
        "omit them, as in vLLM; none: ignore them",
    )

    encoder_urls: tuple[str, ...] = setting(
        (),
        metavar="URL[,URL...]",
        rule=(lambda v: all(_is_tcp_url(u) for u in v), "must be tcp://HOST:PORT each"),
        help="encoders (mmis encoder --endpoint) this P0 asks for the encoder outputs of the "
        "images P1 lacks, instead of sending P1 their pixels (E/PD); each item goes to the live "
        "encoder rendezvous hashing of its mm_hash picks; one that misses 2 s of 1 s pings is "
        "out until it answers. Token: MMIS_ENCODER_TOKEN (needed off loopback). Empty: none",
    )
    encoder_service: str | None = setting(
        None,
        metavar="HOST:PORT",
        rule=(lambda v: v is None or _is_host_port(v), "must be HOST:PORT"),
        help="a headless Service whose every address is an encoder (tcp://ADDR:PORT), "
        "re-resolved every 5 s; beside or instead of --encoder-urls",
    )
    encoder_timeout_s: float = setting(
        5.0,
        rule=POSITIVE,
        help="how long a render waits for the encoders' outputs; an item not answered by then "
        "is sent as pixels (P1 encodes it: a counted fallback)",
    )
    enable_mm_embeds: bool = setting(
        False,
        help="accept precomputed image embeddings as chat parts {'type': 'image_embeds', "
        "'image_embeds': base64 of a .npy [tokens, hidden] array} (+ 'image_grid_thw' for "
        "Qwen2-VL); off: such a part is a 400",
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        metavar="NAME=PATH",
        words=True,
        rule=(
            lambda v: valid_lora_modules(v),
            'must be NAME=PATH or {"name", "path"} JSON each, names unique',
        ),
        help="PEFT LoRA adapters to serve from start-up, vLLM's syntax: 'NAME=PATH ...' (or "
        """'{"name": NAME, "path": PATH}' each); a request whose model is NAME runs under it and """
        "/v1/models lists it with the base model as parent. mmis serve turns on the engine's "
        "--enable-lora when any is given; a bad adapter stops start-up naming it and the cause "
        "(the flag takes one or more words; its variable is comma-separated NAME=PATH)",
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        help="serve POST /v1/load_lora_adapter {lora_name, lora_path} and "
        "/v1/unload_lora_adapter {lora_name} (behind the API key; vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: the routes do not exist (404).",
    )

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may use (``--served-model-name``, else ``--model``)."""
        if not self.served_model_name:
            return (self.model,)
        return tuple(n.strip() for n in self.served_model_name.split(",") if n.strip())

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The API keys ``--api-key`` names (comma-separated), each a tenant; () when unset."""
        if not self.api_key:
            return ()
        return tuple(k.strip() for k in self.api_key.split(",") if k.strip())

    def __post_init__(self) -> None:
        check(self)
        clash = {parse_lora_module(m)[0] for m in self.lora_modules} & set(self.served_names)
        if clash:
            raise ConfigError(f"--lora-modules names the served model {sorted(clash)[0]!r}")


def parse_lora_module(text: str) -> tuple[str, str]:
    """``(name, path)`` of one ``--lora-modules`` entry: ``NAME=PATH`` or vLLM's JSON object
    ``{"name": ..., "path": ...}``; ``ValueError`` saying what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not valid JSON ({exc})") from None
        name, path = (value.get(k) if isinstance(value, dict) else None for k in ("name", "path"))
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{text!r} is not NAME=PATH")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path:
        raise ValueError(f"{text!r} needs a non-empty name and path")
    return name.strip(), path


def valid_lora_modules(entries: tuple[str, ...]) -> bool:
    """Whether every ``--lora-modules`` entry parses and no name repeats."""
    try:
        names = [parse_lora_module(e)[0] for e in entries]
    except ValueError:
        return False
    return len(names) == len(set(names))


def _is_header_name(name: str) -> bool:
    """An HTTP field name (RFC 9110 token characters)."""
    return bool(name) and all(c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in name)


def _is_tcp_url(url: str) -> bool:
    scheme, sep, rest = url.partition("://")
    return scheme == "tcp" and bool(sep) and _is_host_port(rest)


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _is_network(cidr: str) -> bool:
    try:
        ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False
    return True
