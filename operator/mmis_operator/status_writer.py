"""The one writer of an MMInferenceService's status, and the one rule for its Events.

Both the reconciler (Ready/Progressing/Degraded, :mod:`status`) and the coherence probe
(``CacheCoherent`` and ``status.cache``, :mod:`coherence`) store through :func:`write`.

Invariants:
- Read-modify-write on the freshest object: each try GETs the resource, computes the update
  from it with the caller's pure ``compute``, merges it (:func:`status.merged_status`) and PUTs
  it with that object's ``resourceVersion``. A 409 (or no answer) re-reads and recomputes, so
  what others stored meanwhile (other fields, other condition types) survives; after
  ``RETRIES`` tries it raises ``KubeError(409)``.
- An unchanged status is not written; a resource that is gone or being deleted (before the
  read or between the read and the write: a 404 on the PUT) is left alone.
- Events follow a successful write only: one per condition transition, typed by
  :func:`event_type`; posting is best effort (the status already says it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from mmis_operator import conditions, status
from mmis_operator import resource as r
from mmis_operator.kube import Kube, KubeError, service_path

logger = logging.getLogger(__name__)
RETRIES = 8
HEALTHY = {r.READY: "True", r.DEGRADED: "False", r.CACHE_COHERENT: "True", r.ROUTING: "True"}


def event_type(change: conditions.Transition) -> str | None:
    """``Warning`` when a condition misses its healthy status (Ready, CacheCoherent and Routing
    True, Degraded False), else ``Normal``; None: no Event. Progressing has no healthy status.

    Two exceptions, both "not news": a Ready written not-True for the first time (pods
    starting; a real problem shows as Degraded) is Normal, and a first Degraded=False posts
    nothing.
    """
    new, first = change.new, change.old_status is None
    if first and new.type == r.DEGRADED and new.status == "False":
        return None
    healthy = HEALTHY.get(new.type)
    if healthy is None or new.status == healthy or (first and new.type == r.READY):
        return "Normal"
    return "Warning"


def write(
    kube: Kube,
    namespace: str,
    name: str,
    compute: Callable[[Mapping[str, Any]], status.DesiredStatus],
    observed_generation: int | None = None,
) -> dict[str, Any] | None:
    """Store ``compute(fresh object)``; returns the stored (or unchanged) object, None if gone."""
    for _ in range(RETRIES):
        obj = kube.get(service_path(namespace, name))
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return None
        desired = compute(obj)
        old = obj.get("status") or {}
        generation = obj["metadata"].get("generation")
        new = status.merged_status(old, desired, generation, observed_generation)
        if new == old:
            return obj
        try:
            stored = kube.replace_status({**obj, "status": new})
        except KubeError as exc:
            if exc.status in (409, 0):
                continue
            if exc.status == 404:  # deleted between the read and the write
                return None
            raise
        for change in conditions.transitions(old.get("conditions"), desired.conditions):
            kind = event_type(change)
            if kind is None:
                continue
            try:
                kube.post_event(stored, kind, change.new.reason, change.new.message)
            except KubeError as exc:
                logger.warning("could not post event %s: %s", change.new.reason, exc)
        return stored
    raise KubeError(409, f"status of {namespace}/{name} kept changing; will retry")
