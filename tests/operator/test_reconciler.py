"""Unit tests of the Reconciler's status writing against an in-memory stand-in for the API.

The stand-in keeps one object with a resourceVersion and answers 409 to stale writes, like
the API server; the real API server paths are covered in tests/kube/test_operator_mmis.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from mmis_operator.kube import KubeError
from mmis_operator.reconciler import Reconciler


class FakeKube:
    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj
        self.obj["metadata"]["resourceVersion"] = "1"
        self.events: list[tuple[str, str]] = []
        self.writes = 0
        self.interfere = 0  # how many writes a concurrent writer wins first

    def get(self, path: str) -> dict[str, Any] | None:
        if path.endswith("/mminferenceservices/llava"):
            return copy.deepcopy(self.obj)
        return None

    def replace_status(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        if self.interfere:
            self.interfere -= 1
            # someone else adds their condition first: our resourceVersion is now stale
            status = self.obj.setdefault("status", {})
            status.setdefault("conditions", []).append(
                {"type": "CacheCoherent", "status": "True", "reason": "LowDrift"}
            )
            self._bump()
        if obj["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise KubeError(409, "the object has been modified", "Conflict")
        self.obj["status"] = copy.deepcopy(obj["status"])
        self._bump()
        return copy.deepcopy(self.obj)

    def _bump(self) -> None:
        meta = self.obj["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def post_event(self, involved: Any, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason))


def _dep(ready: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": ready,
                   "updatedReplicas": 2},
    }  # fmt: skip


def test_conflict_is_retried_on_the_fresh_object_keeping_foreign_conditions(
    sample: dict[str, Any],
) -> None:
    kube = FakeKube(sample)
    kube.interfere = 1
    stored = Reconciler(kube).write_status("ml", "llava", _dep(2), observed_generation=3)  # type: ignore[arg-type]
    assert stored is not None
    assert kube.writes == 2
    types = [c["type"] for c in kube.obj["status"]["conditions"]]
    assert types == ["CacheCoherent", "Ready", "Progressing", "Degraded"]
    assert kube.obj["status"]["observedGeneration"] == 3


def test_events_only_on_transitions(sample: dict[str, Any]) -> None:
    kube = FakeKube(sample)
    rec = Reconciler(kube)  # type: ignore[arg-type]
    rec.write_status("ml", "llava", _dep(1))
    assert ("Normal", "ReplicasNotReady") in kube.events
    kube.events.clear()
    rec.write_status("ml", "llava", _dep(1))  # nothing changed: no write, no event
    assert kube.events == []
    rec.write_status("ml", "llava", _dep(2))
    assert kube.events == [("Normal", "AllReplicasReady"), ("Normal", "RolloutComplete")]
    kube.events.clear()
    rec.write_status("ml", "llava", _dep(0))
    assert ("Warning", "ReplicasNotReady") in kube.events


def test_gives_up_after_persistent_conflicts(sample: dict[str, Any]) -> None:
    kube = FakeKube(sample)
    kube.interfere = 100
    with pytest.raises(KubeError, match="kept changing"):
        Reconciler(kube).write_status("ml", "llava", _dep(2))  # type: ignore[arg-type]
