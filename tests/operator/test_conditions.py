from __future__ import annotations

import pytest

from mmis_operator import status
from mmis_operator.status import Condition

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def test_upsert_keeps_other_conditions_in_place() -> None:
    coherent = {"type": "CacheCoherent", "status": "True", "reason": "LowDrift", "message": "m"}
    start = [coherent]
    out = status.upsert(start, Condition("Ready", "True", "AllReplicasReady", "ok"), 4, T0)
    assert out[0] == coherent
    assert out[1]["type"] == "Ready"
    assert out[1]["observedGeneration"] == 4
    assert start == [coherent]  # not mutated


def test_transition_time_moves_only_with_status() -> None:
    first = status.upsert([], Condition("Ready", "False", "Creating", "a"), 1, T0)
    same = status.upsert(first, Condition("Ready", "False", "ReplicasNotReady", "b"), 2, T1)
    assert same[0]["lastTransitionTime"] == T0
    assert same[0]["reason"] == "ReplicasNotReady"
    flipped = status.upsert(same, Condition("Ready", "True", "AllReplicasReady", "c"), 2, T1)
    assert flipped[0]["lastTransitionTime"] == T1


def test_transitions() -> None:
    before = [{"type": "Ready", "status": "False"}, {"type": "Degraded", "status": "False"}]
    new = [
        Condition("Ready", "True", "AllReplicasReady", ""),
        Condition("Degraded", "False", "AsExpected", ""),
        Condition("Progressing", "True", "RollingOut", ""),
    ]
    found = {(t.type, t.old_status, t.new.status) for t in status.transitions(before, new)}
    assert found == {("Ready", "False", "True"), ("Progressing", None, "True")}


@pytest.mark.parametrize(("status", "reason"), [("yes", "Ok"), ("True", "not camel"), ("True", "")])
def test_condition_values_are_checked(status: str, reason: str) -> None:
    with pytest.raises(ValueError):
        Condition("Ready", status, reason, "")
