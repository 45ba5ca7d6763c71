"""The endpoint picker's configuration: one owner for the text ``mmis-epp`` reads
(``router/``, docs/ROUTING.md), used by the operator's routing objects and by the routing
tests, so what is tested is what is deployed.

Invariants:
- The event ports are the engine container's ``--kv-events-endpoint`` /
  ``--kv-events-replay-endpoint`` / ``--mm-events-endpoint`` / ``--mm-events-replay-endpoint``
  (:func:`engine_event_args`) and the picker's ``mmis-cache-scorer`` parameters: the two
  always agree because both come from :class:`EventPorts`.
- The metrics the framework scrapes are mmis's three model-server-protocol gauges
  (``server/mmis/telemetry/catalog.py``: ``mmis:num_requests_waiting``,
  ``mmis:num_requests_running``, ``mmis:kv_cache_usage_perc``), read from the front end's
  operations port.
- The profile composes the cache scorer with the framework's queue and KV-utilisation
  scorers; a request whose keys or events are missing scores 0 on the cache scorer for every
  pod, so load alone decides and the request never fails for lack of cache data.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

CACHE_SCORER = "mmis-cache-scorer"
ENGINE_NAME = "mmis"  # the framework's engine label for our metric names
METRICS = {
    "queuedRequestsSpec": "mmis:num_requests_waiting",
    "runningRequestsSpec": "mmis:num_requests_running",
    "kvUsageSpec": "mmis:kv_cache_usage_perc",
}
CACHE_WEIGHT = 3  # the cache scorer's weight against 1 each for queue and KV usage


@dataclasses.dataclass(frozen=True)
class EventPorts:
    """Where a pod's engine publishes its cache events (ZMQ, vLLM's framing)."""

    kv: int = 5557
    kv_replay: int = 5558
    mm: int = 5559
    mm_replay: int = 5560


def engine_event_args(ports: EventPorts, host: str = "*") -> list[str]:
    """The engine flags that publish both streams on ``host`` (``*``: every interface)."""
    return [
        "--kv-events-endpoint", f"tcp://{host}:{ports.kv}",
        "--kv-events-replay-endpoint", f"tcp://{host}:{ports.kv_replay}",
        "--mm-events-endpoint", f"tcp://{host}:{ports.mm}",
        "--mm-events-replay-endpoint", f"tcp://{host}:{ports.mm_replay}",
    ]  # fmt: skip


def picker_config(
    ops_port: int,
    ports: EventPorts | None = None,
    *,
    cache_weight: int = CACHE_WEIGHT,
    keys_timeout_ms: int = 300,
    silence_seconds: float = 10.0,
) -> dict[str, Any]:
    """The ``EndpointPickerConfig`` (GIE v1.5.0's schema) as a dict; :func:`render` for text.

    ``ops_port`` is the front end's operations port: its ``/metrics`` and its
    ``POST /internal/block_keys``. ``silence_seconds``: a pod whose replay socket has not
    answered for that long is scored as holding nothing until it answers again.
    """
    ports = ports or EventPorts()
    scorer_params = {
        "kvEventsPort": ports.kv,
        "kvReplayPort": ports.kv_replay,
        "mmEventsPort": ports.mm,
        "mmReplayPort": ports.mm_replay,
        "keysPort": ops_port,
        "keysTimeoutMs": keys_timeout_ms,
        "silenceSeconds": silence_seconds,
    }
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": CACHE_SCORER, "parameters": scorer_params},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "max-score-picker"},
            {"type": "openai-parser"},
            {
                "type": "metrics-data-source",
                "parameters": {"scheme": "http", "path": "/metrics"},
            },
            {
                "type": "core-metrics-extractor",
                "parameters": {
                    "defaultEngine": ENGINE_NAME,
                    "engineConfigs": [{"name": ENGINE_NAME, **METRICS}],
                },
            },
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": CACHE_SCORER, "weight": cache_weight},
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
        "parser": {"pluginRef": "openai-parser"},
    }


def render(config: dict[str, Any]) -> str:
    """The config as the picker's ``--config-text`` (JSON is YAML)."""
    return json.dumps(config, indent=1, sort_keys=False)
