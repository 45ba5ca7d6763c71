"""Typed errors of the telemetry package.

Invariant: bad input (an unknown label value, a malformed stats snapshot, a bad tracing
setting) raises one of these with a message naming the offending value, never a bare
``AssertionError`` or a late ``TypeError`` deep inside a library.
"""

from __future__ import annotations


class TelemetryError(ValueError):
    """Base class of every telemetry input error."""


class LabelValueError(TelemetryError):
    """A label value outside its closed set (labels must stay low-cardinality)."""


class StatsSnapshotError(TelemetryError):
    """An engine stats snapshot that is not a mapping of known keys to numbers."""


class TracingConfigError(TelemetryError):
    """A tracing setting (endpoint, protocol, sampler, ratio) that cannot be honoured."""


class CacheEventError(TelemetryError):
    """A cache span event with an unknown name or out-of-range counts."""
