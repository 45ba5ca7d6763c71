"""The Reconciler's status writes against the in-memory resource store (conftest.FakeStore)."""

from __future__ import annotations

import copy
import threading
import time
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
    rec.write_status("ml", "llava", _dep(0))
    assert ("Normal", "ReplicasNotReady") in store.events
    store.events.clear()
    rec.write_status("ml", "llava", _dep(0))  # nothing changed: no write, no event
    assert store.events == []
    rec.write_status("ml", "llava", _dep(1))  # one pod serves: Ready, while it scales
    assert store.events == [("Normal", "SomeReplicasReady")]
    store.events.clear()
    rec.write_status("ml", "llava", _dep(2))  # Ready stays True: only Progressing moves
    assert store.events == [("Normal", "RolloutComplete")]
    store.events.clear()
    rec.write_status("ml", "llava", _dep(1))  # one pod lost, one serves: no Warning
    assert [kind for kind, _ in store.events] == ["Normal"]
    store.events.clear()
    rec.write_status("ml", "llava", _dep(0))
    assert ("Warning", "ReplicasNotReady") in store.events


def test_gives_up_after_persistent_conflicts(store: Any) -> None:
    store.rival, store.conflicts = _add_coherent, 100
    with pytest.raises(KubeError, match="kept changing"):
        Reconciler(store).write_status("ml", "llava", _dep(2))


def test_status_reads_the_pods_only_while_not_settled(store: Any) -> None:
    rec = Reconciler(store)
    rec.write_status("ml", "llava", _dep(2))
    assert store.lists == 0  # rolled out and ready: no pod LIST
    store.pods = [
        {"metadata": {"name": "llava-1", "labels": {"mmis.dev/service": "llava"}},
         "status": {"containerStatuses": [
             {"name": "engine", "state": {"waiting": {"reason": "ErrImagePull"}}}]}}
    ]  # fmt: skip
    rec.write_status("ml", "llava", _dep(1))
    assert store.lists == 1
    degraded = [c for c in store.obj["status"]["conditions"] if c["type"] == "Degraded"]
    assert degraded[0]["reason"] == "ErrImagePull"
    assert ("Warning", "ErrImagePull") in store.events


def test_schema_refusals_are_permanent() -> None:
    from mmis_operator.reconciler import rejected

    typo = (
        "failed to create typed patch object (ns/x; apps/v1, Kind=Deployment): "
        '.spec.template.spec.containers[name="engine"].imagePullPolicyy: field not declared'
    )
    assert rejected(KubeError(500, typo))
    assert rejected(KubeError(422, "Deployment.apps is invalid"))
    assert not rejected(KubeError(500, "etcdserver: request timed out"))
    assert not rejected(KubeError(0, "connection refused"))


def test_a_late_deployment_event_does_not_undo_a_newer_status(store: Any) -> None:
    """kopf may deliver a Deployment event after a refresh read a newer Deployment: the status
    follows the Deployment as it is now, never the late body (it once wrote Ready False at 0/1
    right after Ready True, a Warning for a Ready never lost: tests/kube/test_operator_mmis.py)."""
    meta = {"name": "llava", "namespace": "ml", "generation": 1,
            "labels": {"mmis.dev/service": "llava"}}  # fmt: skip
    current = {**_dep(2), "metadata": meta}
    own_get = store.get
    store.get = lambda path: (
        copy.deepcopy(current) if path.endswith("/deployments/llava") else own_get(path)
    )
    rec = Reconciler(store)
    rec.write_status("ml", "llava", current)
    rec.deployment_changed({**_dep(0), "metadata": meta}, deleted=False)  # the late body
    ready = [c for c in store.obj["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True", ready
    assert not [e for e in store.events if e[0] == "Warning"], store.events


def test_status_writes_land_in_the_order_of_their_reads(store: Any) -> None:
    """A reconcile (its own thread) read the Deployment at 0/1 ready; a refresh read it at 2/2
    while the reconcile was still on its way to the write. The writes go one at a time per
    resource, so the refresh's newer read lands last: Ready True, no Warning (without the lock
    the reconcile's older 0/1 landed last: Ready False right after True, in
    tests/kube/test_operator_mmis.py's scale test)."""
    meta = {"name": "llava", "namespace": "ml", "generation": 1,
            "labels": {"mmis.dev/service": "llava"}}  # fmt: skip
    first_read, second_started = threading.Event(), threading.Event()
    reads: list[int] = []
    own_get = store.get

    def get(path: str) -> Any:
        if not path.endswith("/deployments/llava"):
            return own_get(path)
        reads.append(len(reads))
        if len(reads) == 1:  # the reconcile's read: it stalls until the refresh is under way
            first_read.set()
            assert second_started.wait(5)
            time.sleep(0.2)  # room for the refresh to write first, were it not held
            return {**_dep(0), "metadata": meta}
        return {**_dep(2), "metadata": meta}

    store.get = get
    rec = Reconciler(store)
    rec.write_status("ml", "llava", {**_dep(2), "metadata": meta})  # Ready True before
    reconcile = threading.Thread(target=rec.refresh_status, args=("ml", "llava"))
    reconcile.start()
    assert first_read.wait(5)
    refresh = threading.Thread(target=rec.refresh_status, args=("ml", "llava"))
    refresh.start()
    second_started.set()
    reconcile.join(10)
    refresh.join(10)
    ready = [c for c in store.obj["status"]["conditions"] if c["type"] == "Ready"]
    assert len(reads) == 2 and ready[0]["status"] == "True", (reads, ready)
