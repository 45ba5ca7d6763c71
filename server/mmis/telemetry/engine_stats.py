"""P1's figures as a plain dict: what the engine's ``stats`` utility call returns.

P1 builds an :class:`EngineStats` and answers ``stats`` with :meth:`EngineStats.to_dict`;
P0 hands that dict to :class:`~mmis.telemetry.stats_collector.EngineStatsCollector`,
which parses it back with :meth:`EngineStats.from_dict`.

Invariants:
- The wire form is a flat ``dict[str, int | float]``: msgspec carries it in
  ``UtilityResult.result`` with no new message type.
- Compatible both ways: unknown keys (a newer P1) are ignored, missing keys (an older P1) take
  their defaults.
- Counters are cumulative since P1 started, never negative; gauges are current values;
  ``kv_cache_usage`` is a fraction in [0, 1]. Anything else (a string, a bool, NaN, a negative
  count, a usage above 1) raises :class:`StatsSnapshotError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mmis.telemetry.errors import StatsSnapshotError

STATS_METHOD = "stats"  # the UtilityCall.method P0 uses to fetch a snapshot


@dataclasses.dataclass(frozen=True)
class EngineStats:
    # gauges
    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage: float = 0.0
    # cumulative counters
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_evictions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    receiver_cache_queries: int = 0
    receiver_cache_hits: int = 0
    receiver_cache_evictions: int = 0
    receiver_cache_stores: int = 0  # items stored: each crossed from a P0 to P1 once
    # encoder outputs refused (engine/encoder_inputs.py), by reason
    encoder_outputs_rejected_dtype: int = 0
    encoder_outputs_rejected_shape: int = 0
    encoder_outputs_rejected_nonfinite: int = 0
    encoder_outputs_rejected_pixels: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check(field.name, getattr(self, field.name))
        if self.kv_cache_usage > 1.0:
            raise StatsSnapshotError(
                f"kv_cache_usage={self.kv_cache_usage} is above 1 (a fraction)"
            )
        for prefix in ("encoder_cache", "prefix_cache", "receiver_cache"):
            hits, queries = getattr(self, f"{prefix}_hits"), getattr(self, f"{prefix}_queries")
            if hits > queries:
                raise StatsSnapshotError(f"{prefix}_hits={hits} exceeds {prefix}_queries={queries}")

    def to_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, snapshot: Any) -> EngineStats:
        if not isinstance(snapshot, Mapping):
            raise StatsSnapshotError(
                f"an engine stats snapshot is a mapping, got {type(snapshot).__name__}"
            )
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in snapshot.items() if key in known})

    def value(self, key: str) -> float:
        """The figure for a catalog ``snapshot_key``."""
        if key not in KEYS:
            raise StatsSnapshotError(f"{key!r} is not an engine stats key (known: {sorted(KEYS)})")
        return float(getattr(self, key))


def _check(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise StatsSnapshotError(f"engine stats {key!r} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise StatsSnapshotError(f"engine stats {key!r} must be finite and >= 0, got {value!r}")


KEYS = frozenset(field.name for field in dataclasses.fields(EngineStats))
