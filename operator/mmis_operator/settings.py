"""Operator options (from the command line) and the kopf settings derived from them.

Invariants:
- Everything kopf stores on objects lives under ``mmis.dev``: handler progress and the
  last-handled spec as ``mmis.dev/...`` annotations; nothing is written into ``status`` by
  kopf. No handler needs a finalizer (``handlers._no_finalizer``): ``mmis.dev/finalizer``
  is only the name kopf looks for to remove it from resources an older operator finalized.
- Watches always have a server-side and a client-side timeout, and requests a timeout, so a
  restarted or silent API server never wedges the operator: watches re-establish themselves.
- Peering is off (standalone) unless a peering name is given; then a standby replica with a
  lower priority waits while the active one holds the peering object.
"""

from __future__ import annotations

import dataclasses
import logging

import kopf

from mmis_operator import resource as r


@dataclasses.dataclass(frozen=True)
class Options:
    namespaces: tuple[str, ...] = ()  # empty: cluster-wide
    peering: str | None = None
    priority: int = 0
    liveness_endpoint: str | None = None
    watch_server_timeout: int = 60  # sent as ?timeoutSeconds=, which must be an integer
    watch_client_timeout: float = 90.0
    connect_timeout: float = 10.0
    request_timeout: float = 60.0
    resync_seconds: float = 60.0
    workers: int | None = None
    event_level: int = logging.WARNING
    # the CacheCoherent probe: interval, per-pod HTTP timeout, and whether the test-only
    # ``mmis.dev/stats-endpoints`` annotation may redirect it (never in production)
    probe_seconds: float = 30.0
    probe_timeout: float = 2.0
    allow_stats_endpoint_override: bool = False
    # testing knobs in a resource (spec.engine.faultEvictRate) are refused unless this is set
    allow_fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.watch_client_timeout <= self.watch_server_timeout:
            raise ValueError(
                "watch client timeout must exceed the server timeout "
                f"({self.watch_client_timeout} <= {self.watch_server_timeout})"
            )
        if self.resync_seconds <= 0:
            raise ValueError(f"resync interval must be positive, got {self.resync_seconds}")
        if self.probe_seconds <= 0 or self.probe_timeout <= 0:
            raise ValueError(
                f"probe interval and timeout must be positive, got {self.probe_seconds}, "
                f"{self.probe_timeout}"
            )


def configure(settings: kopf.OperatorSettings, options: Options) -> kopf.OperatorSettings:
    """Apply ``options`` to ``settings`` (in place) and return it."""
    settings.persistence.finalizer = r.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=r.ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=r.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = int(options.watch_server_timeout)
    settings.watching.client_timeout = options.watch_client_timeout
    settings.watching.connect_timeout = options.connect_timeout
    settings.networking.request_timeout = options.request_timeout
    settings.networking.connect_timeout = options.connect_timeout
    settings.posting.level = options.event_level
    settings.posting.reporting_component = r.REPORTING_COMPONENT
    settings.peering.standalone = options.peering is None
    settings.peering.name = options.peering or "default"
    settings.peering.priority = options.priority
    settings.peering.clusterwide = not options.namespaces
    if options.workers is not None:
        settings.execution.max_workers = options.workers
    return settings
