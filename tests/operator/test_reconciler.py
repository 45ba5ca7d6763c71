"""The Reconciler's status writes against the in-memory resource store (conftest.FakeStore)."""

from __future__ import annotations

from typing import Any

import pytest

from mmis_operator.kube import KubeError
from mmis_operator.reconciler import Reconciler


def _dep(ready: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": ready,
                   "updatedReplicas": 2},
    }  # fmt: skip


def _add_coherent(status: dict[str, Any]) -> None:
    status.setdefault("conditions", []).append(
        {"type": "CacheCoherent", "status": "True", "reason": "LowDrift"}
    )


def test_conflict_is_retried_on_the_fresh_object_keeping_foreign_conditions(store: Any) -> None:
    store.rival, store.conflicts = _add_coherent, 1  # someone else adds their condition first
    stored = Reconciler(store).write_status("ml", "llava", _dep(2), observed_generation=3)
    assert stored is not None
    assert (store.tries, store.writes) == (2, 1)  # the first try met a 409
    types = [c["type"] for c in store.obj["status"]["conditions"]]
    assert types == ["CacheCoherent", "Ready", "Progressing", "Degraded"]
    assert store.obj["status"]["observedGeneration"] == 3


def test_events_only_on_transitions(store: Any) -> None:
    rec = Reconciler(store)
    rec.write_status("ml", "llava", _dep(1))
    assert ("Normal", "ReplicasNotReady") in store.events
    store.events.clear()
    rec.write_status("ml", "llava", _dep(1))  # nothing changed: no write, no event
    assert store.events == []
    rec.write_status("ml", "llava", _dep(2))
    assert store.events == [("Normal", "AllReplicasReady"), ("Normal", "RolloutComplete")]
    store.events.clear()
    rec.write_status("ml", "llava", _dep(0))
    assert ("Warning", "ReplicasNotReady") in store.events


def test_gives_up_after_persistent_conflicts(store: Any) -> None:
    store.rival, store.conflicts = _add_coherent, 100
    with pytest.raises(KubeError, match="kept changing"):
        Reconciler(store).write_status("ml", "llava", _dep(2))
