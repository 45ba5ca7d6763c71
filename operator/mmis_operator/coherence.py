"""The ``CacheCoherent`` condition and ``status.cache``, computed from pods' drift stats (pure).

Each ready pod's front end answers ``GET /stats/cache`` with its drift window: ``drift_rate``
(drift misses / shadow hits), ``hit_rate``, ``retry_rate`` and the raw window deltas. This
module turns the answers of N pods and the spec's threshold into one condition and the
``status.cache`` object (``kubectl get mmis`` shows ``status.cache.driftRate`` as ``Drift``).

Invariants:
- Pure: no I/O, no clock. The same probe results always give the same condition and dict.
- The condition is judged on the *worst* pod (one drifting pod is actionable on its own):
  False / ``DriftRateHigh`` when its rate exceeds the threshold, True / ``DriftRateNormal``
  otherwise; the message names that rate, the threshold and the pod.
- ``Unknown`` when there is nothing to judge: ``NoData`` (no ready pod), ``ProbeFailed`` (no
  pod answered).
- No traffic (pods answer, but no shadow hit in any pod's window, so a 0.0 rate carries no
  evidence) is ``NoTraffic`` with ``hold_status``: the stored True/False verdict is kept, its
  message says since when the window had no traffic, and no Event is posted (see
  :mod:`conditions`); with no verdict yet it is ``Unknown``. A healthy service that goes idle
  and busy again never flaps through ``Unknown``.
- ``status.cache`` rates are pooled over the answering pods (sums of the window deltas) and
  rounded, so an unchanged picture never rewrites the status.
- A malformed answer is a :class:`StatsError` for that pod (treated as a failed probe), never
  an exception out of :func:`evaluate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from mmis_operator import resource as r
from mmis_operator.conditions import Condition

DRIFT_HIGH = "DriftRateHigh"
DRIFT_NORMAL = "DriftRateNormal"
NO_DATA = "NoData"
NO_TRAFFIC = "NoTraffic"
PROBE_FAILED = "ProbeFailed"
DIGITS = 4


class StatsError(ValueError):
    """A ``/stats/cache`` answer that is not the documented JSON object."""


@dataclasses.dataclass(frozen=True)
class PodStats:
    """One pod's drift window (the fields of ``GET /stats/cache``)."""

    drift_rate: float
    hit_rate: float
    retry_rate: float
    window_seconds: float
    shadow_hits: float
    drift_misses: float
    queries: float
    retries: float
    requests: float


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The outcome of probing one pod: its stats, or why there are none."""

    pod: str
    stats: PodStats | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Coherence:
    condition: Condition
    cache: dict[str, Any]


def parse_stats(body: Any) -> PodStats:
    """Validate a decoded ``/stats/cache`` body; :class:`StatsError` names the bad field."""
    if not isinstance(body, Mapping):
        raise StatsError(f"expected a JSON object, got {type(body).__name__}")
    values: dict[str, float] = {}
    for field in dataclasses.fields(PodStats):
        raw = body.get(field.name)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise StatsError(f"field {field.name!r} must be a number, got {raw!r}")
        value = float(raw)
        if not math.isfinite(value) or value < 0:
            raise StatsError(f"field {field.name!r} must be finite and >= 0, got {raw!r}")
        values[field.name] = value
    return PodStats(**values)


def _ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, DIGITS) if denominator > 0 else 0.0


def _pooled(answered: Sequence[tuple[str, PodStats]], probed: int) -> dict[str, Any]:
    stats = [s for _, s in answered]
    hits = sum(s.hit_rate * s.queries for s in stats)
    return {
        "driftRate": _ratio(sum(s.drift_misses for s in stats), sum(s.shadow_hits for s in stats)),
        "hitRate": _ratio(hits, sum(s.queries for s in stats)),
        "retryRate": _ratio(sum(s.retries for s in stats), sum(s.requests for s in stats)),
        "windowSeconds": max(s.window_seconds for s in stats),
        "shadowHits": int(sum(s.shadow_hits for s in stats)),
        "driftMisses": int(sum(s.drift_misses for s in stats)),
        "podsProbed": probed,
        "podsAnswered": len(stats),
    }


def evaluate(results: Sequence[ProbeResult], threshold: float) -> Coherence:
    """The ``CacheCoherent`` condition and ``status.cache`` for these probe results."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"drift threshold must be within [0, 1], got {threshold}")
    probed = len(results)
    if probed == 0:
        condition = Condition(
            r.CACHE_COHERENT,
            "Unknown",
            NO_DATA,
            "no ready pod to probe: the drift rate is measured on ready pods' /stats/cache",
        )
        return Coherence(condition, {"podsProbed": 0, "podsAnswered": 0})
    answered = [(p.pod, p.stats) for p in results if p.stats is not None]
    if not answered:
        failures = "; ".join(f"{p.pod}: {p.error or 'no answer'}" for p in results[:3])
        condition = Condition(
            r.CACHE_COHERENT,
            "Unknown",
            PROBE_FAILED,
            f"no pod answered GET /stats/cache ({probed} probed): {failures}",
        )
        return Coherence(condition, {"podsProbed": probed, "podsAnswered": 0})
    cache = _pooled(answered, probed)
    window = f"{cache['windowSeconds']:g}s"
    if cache["shadowHits"] == 0:
        condition = Condition(
            r.CACHE_COHERENT,
            "Unknown",
            NO_TRAFFIC,
            f"no traffic in the last {window} window: no shadow hit on any of "
            f"{len(answered)} pod(s), so the drift rate carries no evidence",
            hold_status=True,
        )
        return Coherence(condition, cache)
    worst_pod, worst = max(answered, key=lambda item: (item[1].drift_rate, item[0]))
    rate = round(worst.drift_rate, DIGITS)
    cache["worstPod"] = worst_pod
    detail = (
        f"drift rate {rate:g} on pod {worst_pod} "
        f"({worst.drift_misses:g} misses / {worst.shadow_hits:g} shadow hits in {window})"
    )
    pods = f"{len(answered)}/{probed} pods answered, service-wide {cache['driftRate']:g}"
    if worst.drift_rate > threshold:
        condition = Condition(
            r.CACHE_COHERENT,
            "False",
            DRIFT_HIGH,
            f"{detail} exceeds the threshold {threshold:g} ({pods}); the front end retries "
            "with data, but check P1 restarts, its cache budget and the fault knob",
        )
    else:
        condition = Condition(
            r.CACHE_COHERENT,
            "True",
            DRIFT_NORMAL,
            f"{detail} is within the threshold {threshold:g} ({pods})",
        )
    return Coherence(condition, cache)
