"""One answer for N P0 processes (``--api-servers N``): merged ``/metrics``, summed drift window.

Each of the N processes serves its own figures on a private socket (OpenMetrics text, every
P0 family labelled with its ``api_server`` index: :meth:`MMISMetrics.exposition`); whichever
process answers the public ``/metrics`` or ``/stats/cache`` reads its siblings' and merges
them here (the supervisor's wiring is ``mmis.entrypoints.api_servers``).

Invariants:
- :func:`merge_expositions`: every family appears once, with the samples of every process
  (their ``api_server`` labels keep them apart); P1's figures
  (:data:`~mmis.telemetry.metrics.ENGINE_FAMILIES`) come from the answering process only, so
  they appear once, not N times. A sibling's text that does not parse is skipped whole (a
  process dying mid-answer), never half-merged.
- :func:`sum_drift_stats`: the drift window of N processes is the sum of their windows'
  counts, the rates recomputed from the sums (not averaged), in exactly the JSON shape of
  :meth:`~mmis.telemetry.drift.DriftWindow.stats` (the operator's coherence probe reads it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from mmis.telemetry.errors import TelemetryError
from mmis.telemetry.metrics import ENGINE_FAMILIES, encode

log = logging.getLogger(__name__)

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=allow-utf-8"
"""The ``Accept`` a process asks its siblings with: OpenMetrics keeps a counter's
``_created`` sample in its family, so the merge never meets a stray ``*_created`` gauge;
``allow-utf-8`` keeps the ``mmis:`` names (prometheus_client's default escaping writes their
samples with an underscore, clashing with the ``mmis_`` twins of the same figures)."""

_COUNTS = ("shadow_hits", "drift_misses", "queries", "retries", "requests")


def _parse(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))


def merge_expositions(
    own: str, siblings: Iterable[str], accept: str | None, extra: Iterable[Metric] = ()
) -> tuple[bytes, str]:
    """One ``/metrics`` body from the answering process's OpenMetrics text (``own``, whose
    P1 figures are kept), its siblings' (P1's figures dropped) and ``extra`` families."""
    merged: dict[str, Metric] = {}

    def add(family: Metric) -> None:
        have = merged.get(family.name)
        if have is None:
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = list(family.samples)
            merged[family.name] = copy
        elif have.type != family.type:
            log.warning(
                "metric %s: type %s vs %s; sibling's dropped", family.name, have.type, family.type
            )
        else:
            have.samples.extend(family.samples)

    for family in _parse(own):
        add(family)
    for text in siblings:
        try:
            families = _parse(text)
        except ValueError as exc:  # a process that died mid-answer: skipped whole
            log.warning("a sibling's metrics did not parse (%s); skipped", exc)
            continue
        for family in families:
            if family.name not in ENGINE_FAMILIES:
                add(family)
    for family in extra:
        add(family)
    return encode(merged.values(), accept)


def sum_drift_stats(windows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The drift window of N processes from each one's ``DriftWindow.stats()``: counts
    summed, rates recomputed from the sums, ``span_seconds`` the longest span."""
    if not windows:
        raise TelemetryError("no drift window to sum")
    sums = {key: float(sum(w[key] for w in windows)) for key in _COUNTS}
    hits = sum(w["hit_rate"] * w["queries"] for w in windows)

    def ratio(numerator: float, denominator: float) -> float:
        return numerator / denominator if denominator > 0 else 0.0

    return {
        "drift_rate": ratio(sums["drift_misses"], sums["shadow_hits"]),
        "hit_rate": ratio(hits, sums["queries"]),
        "retry_rate": ratio(sums["retries"], sums["requests"]),
        "window_seconds": float(windows[0]["window_seconds"]),
        "span_seconds": float(max(w["span_seconds"] for w in windows)),
        **sums,
    }
