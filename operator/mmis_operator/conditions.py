"""Status conditions: upsert one condition without touching the others, and find transitions.

Invariants:
- ``upsert`` returns a new list; the input is never mutated. Conditions of other types (for
  example ``CacheCoherent``, owned by the coherence probe) keep their position and content.
- ``lastTransitionTime`` changes only when ``status`` changes; a new reason or message with the
  same status keeps the old time (Kubernetes API conventions).
- ``status`` is always one of "True", "False", "Unknown"; anything else is a ValueError.
- Every condition written records the generation it describes (``observedGeneration``).
- A condition with ``hold_status`` carries no new evidence (e.g. ``CacheCoherent`` of an idle
  service). Against a stored True/False it keeps that status (so ``lastTransitionTime`` stays)
  and takes its own reason, with a message that says since when and quotes the last verdict;
  with no stored verdict it is written as given (``Unknown``). Once written, later held
  conditions of the same reason leave the entry as it is (the "since" time stays, nothing is
  rewritten). A held condition is never a transition, so it never causes an Event.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

STATUSES = ("True", "False", "Unknown")


@dataclasses.dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str
    hold_status: bool = False  # no new evidence: keep a stored True/False (see the module doc)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"condition {self.type}: status {self.status!r} not in {STATUSES}")
        if not self.reason or not self.reason[0].isupper() or " " in self.reason:
            raise ValueError(f"condition {self.type}: reason {self.reason!r} must be CamelCase")


@dataclasses.dataclass(frozen=True)
class Transition:
    type: str
    old_status: str | None  # None: the condition did not exist
    new: Condition


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find(conditions: Iterable[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    for item in conditions:
        if item.get("type") == kind:
            return item
    return None


def upsert(
    conditions: Sequence[Mapping[str, Any]] | None,
    condition: Condition,
    generation: int | None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Insert or replace the condition of ``condition.type``; keep every other condition."""
    stamp = now or now_rfc3339()
    result: list[dict[str, Any]] = []
    replaced = False
    for item in conditions or ():
        if item.get("type") != condition.type:
            result.append(dict(item))
            continue
        replaced = True
        settled = held(item, condition, stamp) if condition.hold_status else condition
        same = item.get("status") == settled.status and item.get("lastTransitionTime")
        result.append(_entry(settled, generation, item["lastTransitionTime"] if same else stamp))
    if not replaced:
        fresh = held({}, condition, stamp) if condition.hold_status else condition
        result.append(_entry(fresh, generation, stamp))
    return result


def transitions(
    before: Sequence[Mapping[str, Any]] | None, new: Iterable[Condition]
) -> list[Transition]:
    """Conditions in ``new`` whose status differs from ``before`` (or that are new)."""
    found = []
    for condition in new:
        if condition.hold_status:
            continue  # keeps a stored status, or is Unknown where no verdict was ever given
        old = find(before or (), condition.type)
        old_status = None if old is None else old.get("status")
        if old_status != condition.status:
            found.append(Transition(condition.type, old_status, condition))
    return found


def held(stored: Mapping[str, Any], condition: Condition, stamp: str) -> Condition:
    """What a ``hold_status`` condition becomes over the ``stored`` entry of its type."""
    status = stored.get("status")
    if stored.get("reason") == condition.reason and status in STATUSES:
        return dataclasses.replace(condition, status=status, message=str(stored.get("message")))
    since = f"{condition.message} (since {stamp})"
    if status in ("True", "False"):
        last = f"last verdict {stored.get('reason')}: {stored.get('message')}"
        return dataclasses.replace(condition, status=status, message=f"{since}; {last}")
    return dataclasses.replace(condition, message=since)


def _entry(condition: Condition, generation: int | None, stamp: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": condition.type,
        "status": condition.status,
        "reason": condition.reason,
        "message": condition.message,
        "lastTransitionTime": stamp,
    }
    if generation is not None:
        entry["observedGeneration"] = generation
    return entry
