"""The one status writer and its Event rule (the callers' tests: test_reconciler,
test_coherence_probe, test_coherence_idle)."""

from __future__ import annotations

from typing import Any

import pytest

from mmis_operator import status
from mmis_operator.kube import KubeError
from mmis_operator.status import Condition, Transition

DRIFT = Condition("CacheCoherent", "False", "DriftRateHigh", "m")


@pytest.mark.parametrize(
    ("kind", "old", "new", "expected"),
    [
        ("Degraded", None, "False", None),  # not degraded on creation: not news
        ("Degraded", None, "True", "Warning"),
        ("Degraded", "False", "True", "Warning"),
        ("Degraded", "True", "False", "Normal"),
        ("Ready", None, "False", "Normal"),  # pods starting
        ("Ready", "True", "False", "Warning"),  # Ready lost
        ("Ready", "False", "True", "Normal"),
        ("Progressing", None, "True", "Normal"),
        ("Progressing", "True", "False", "Normal"),
        ("CacheCoherent", None, "False", "Warning"),  # a first verdict counts
        ("CacheCoherent", None, "Unknown", "Warning"),  # no pod answered
        ("CacheCoherent", "True", "Unknown", "Warning"),
        ("CacheCoherent", "False", "True", "Normal"),
    ],
)
def test_event_type(kind: str, old: str | None, new: str, expected: str | None) -> None:
    change = Transition(kind, old, Condition(kind, new, "SomeReason", ""))
    assert status.event_type(change) == expected


def _drift(_: Any) -> status.DesiredStatus:
    return status.DesiredStatus({"cache": {"driftRate": 0.5}}, (DRIFT,))


def test_a_resource_being_deleted_or_gone_is_left_alone(store: Any) -> None:
    store.obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert status.write(store, "ml", "llava", _drift) is None
    assert status.write(store, "ml", "other", _drift) is None
    assert (store.tries, store.events) == (0, [])


def test_events_are_best_effort(store: Any) -> None:
    def refuse(*_: Any) -> None:
        raise KubeError(403, "events are forbidden")

    store.post_event = refuse
    stored = status.write(store, "ml", "llava", _drift)
    assert stored is not None and stored["status"]["cache"] == {"driftRate": 0.5}


def test_other_errors_are_not_retried(store: Any) -> None:
    def forbidden(_: Any) -> Any:
        store.tries += 1
        raise KubeError(403, "forbidden")

    store.replace_status = forbidden
    with pytest.raises(KubeError, match="forbidden"):
        status.write(store, "ml", "llava", _drift)
    assert store.tries == 1


def test_a_resource_deleted_between_read_and_write_is_left_alone(store: Any) -> None:
    def gone(_: Any) -> Any:
        store.tries += 1
        raise KubeError(404, 'mminferenceservices.mmis.dev "llava" not found', "NotFound")

    store.replace_status = gone
    assert status.write(store, "ml", "llava", _drift) is None
    assert (store.tries, store.events) == (1, [])
