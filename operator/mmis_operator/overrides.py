"""Merging a user's ``podTemplate`` override over the generated pod template.

Invariants:
- Mappings merge recursively; the override wins on scalars.
- Lists of named items (containers, volumes, env, volumeMounts, ports, ...) merge item by
  item on ``name``: an override entry updates the generated entry of the same name, new
  names are appended, generated entries the override does not mention are kept.
- Except ``volumes``: an override volume replaces the generated volume of the same name
  whole (a volume has exactly one source; merging an ``emptyDir`` with a
  ``persistentVolumeClaim`` would give two, which the API server rejects).
- Any other list is replaced as a whole (``tolerations``, ``args``, ``command``).
- Inputs are never mutated; the result shares no mutable structure with them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

NAMED_LISTS = frozenset(
    {
        "containers",
        "initContainers",
        "ephemeralContainers",
        "volumes",
        "env",
        "volumeMounts",
        "ports",
        "imagePullSecrets",
        "hostAliases",
        "resourceClaims",
    }
)


class OverrideError(ValueError):
    """The override has the wrong shape (e.g. a container entry without a name)."""


REPLACED_BY_NAME = frozenset({"volumes"})


def _merge_named(base: list[Any], override: list[Any], path: str, whole: bool = False) -> list[Any]:
    merged = [copy.deepcopy(item) for item in base]
    index = {item.get("name"): i for i, item in enumerate(merged) if isinstance(item, Mapping)}
    for item in override:
        if not isinstance(item, Mapping) or not item.get("name"):
            raise OverrideError(f"{path}: every entry needs a name, got {item!r}")
        name = item["name"]
        if name in index:
            merged[index[name]] = (
                copy.deepcopy(dict(item))
                if whole
                else merge(merged[index[name]], item, f"{path}[{name}]")
            )
        else:
            index[name] = len(merged)
            merged.append(copy.deepcopy(dict(item)))
    return merged


def merge(base: Mapping[str, Any], override: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Return ``base`` with ``override`` merged over it (see the module invariants)."""
    result: dict[str, Any] = copy.deepcopy(dict(base))
    for key, value in override.items():
        where = f"{path}.{key}" if path else key
        current = result.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            result[key] = merge(current, value, where)
        elif key in NAMED_LISTS and isinstance(value, list):
            base_list = current if isinstance(current, list) else []
            result[key] = _merge_named(base_list, value, where, key in REPLACED_BY_NAME)
        else:
            result[key] = copy.deepcopy(value)
    return result
