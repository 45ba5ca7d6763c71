"""``spec.adapters`` at run time: the LoRA adapters each ready pod holds, brought to the spec's
list without a restart, and ``status.adapters``.

Owns: the internal token the operator derives (:func:`internal_token`), reading a pod's
adapters from its ``/stats/cache`` answer (:func:`held`), the pure plan that turns what a pod
holds into what the spec lists (:func:`plan`), carrying it out on one pod over P0's internal
routes (:func:`sync_pod`), and the status entry per replica (:func:`replica_status`).
The coherence probe (:mod:`mmis_operator.probe`) runs the sync in its cycle, on the answers it
already fetched (one GET per pod per cycle, not two).

Invariants:
- The operator never reads a Secret. It derives each resource's internal token:
  ``hmac_sha256(key, "NAMESPACE/NAME/UID")`` in hex, ``key`` being the operator's
  ``--internal-key`` (the chart's ``adapters.enabled`` generates it once into the Secret
  ``<fullname>-internal-key``); the reconciler writes the same token into ``NAME-internal``
  (create only), which P0 reads as ``--internal-token``. Without a key there is no token to
  send: every replica's entry says so and names the flag and the chart value to set.
- :func:`plan` is pure and minimal: unload what the spec no longer lists, reload (unload, then
  load) a name whose path changed, load what is missing; nothing for a pod that already holds
  the list. Unloads come first, so a pod at its ``--max-cpu-loras`` has room for the loads.
- :func:`sync_pod` never raises: every HTTP call has the probe's short timeout. A refused call
  (a 4xx/5xx with P0's message: a bad adapter, one in use) does not stop the others, so one bad
  entry never keeps the rest of the list from loading; a reload whose unload was refused skips
  its load. A transport failure (connection, timeout) ends that pod's sync for this cycle. Each
  failure is
  reported in its entry; the next cycle plans again from what the pod then holds. The P0
  routes are idempotent (``iface``: same name and path 200, unknown name on unload 200), so a
  retried plan is harmless.
- ``status.adapters`` is one small entry per ready replica: ``{pod, adapters: [names, sorted],
  error?}``, the names those the pod holds after this cycle's sync (what it reported, changed
  by the calls that succeeded).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from mmis_operator.spec import AdapterSpec

LOAD_PATH = "/internal/load_lora_adapter"
UNLOAD_PATH = "/internal/unload_lora_adapter"
ERROR_MAX = 300  # characters of one replica's error in status
NO_KEY = (
    "the operator has no internal key, so it cannot call the pods' /internal/* routes: "
    "helm upgrade the mmis chart with --set adapters.enabled=true (or run the operator with "
    "--internal-key / MMIS_OPERATOR_INTERNAL_KEY), then restart the pods"
)
NO_LORA = (
    "this pod serves no LoRA (its /stats/cache has no 'lora'): it predates spec.adapters and "
    "is replaced by the rollout"
)


def internal_token(key: str, namespace: str, name: str, uid: str) -> str:
    """The internal token of resource ``namespace/name`` (``uid``: its metadata.uid, so a
    resource deleted and created again under the same name gets another token)."""
    message = f"{namespace}/{name}/{uid}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def held(answer: Mapping[str, Any]) -> dict[str, str] | None:
    """Name -> path of the adapters a pod holds, from its ``/stats/cache`` answer's
    ``lora.adapters``; None when the answer has no ``lora`` (LoRA not enabled in the pod).
    A malformed ``lora`` is a ValueError."""
    lora = answer.get("lora")
    if lora is None:
        return None
    items = lora.get("adapters") if isinstance(lora, Mapping) else None
    if not isinstance(items, list):
        raise ValueError(f"lora.adapters must be a list, got {items!r}")
    found: dict[str, str] = {}
    for item in items:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ValueError(f"lora.adapters entries need a name, got {item!r}")
        found[item["name"]] = str(item.get("path") or "")
    return found


@dataclasses.dataclass(frozen=True)
class Action:
    """One call to a pod: ``load`` (``name`` from ``path``) or ``unload`` (``name``)."""

    verb: str  # "load" | "unload"
    name: str
    path: str | None = None

    def body(self) -> dict[str, str]:
        if self.verb == "load":
            return {"lora_name": self.name, "lora_path": str(self.path)}
        return {"lora_name": self.name}


def plan(wanted: Sequence[AdapterSpec], holding: Mapping[str, str]) -> list[Action]:
    """The calls that bring a pod holding ``holding`` (name -> path) to ``wanted``."""
    target = {a.name: a.path for a in wanted}
    actions = [Action("unload", n) for n in sorted(holding) if n not in target]
    changed = [n for n in sorted(holding) if n in target and holding[n] != target[n]]
    actions += [Action("unload", n) for n in changed]
    actions += [Action("load", a.name, a.path) for a in wanted if holding.get(a.name) != a.path]
    return actions


@dataclasses.dataclass(frozen=True)
class Replica:
    """What one pod holds after this cycle's sync, and why not the spec's list if it fails."""

    pod: str
    adapters: tuple[str, ...] = ()
    error: str | None = None


def _cause(response: httpx.Response) -> str:
    try:
        error = response.json().get("error") or {}
        return str(error.get("message") or response.text)
    except (ValueError, AttributeError):
        return response.text


async def sync_pod(
    client: httpx.AsyncClient,
    pod: str,
    base_url: str,
    token: str | None,
    wanted: Sequence[AdapterSpec],
    holding: Mapping[str, str] | None,
) -> Replica:
    """Carry out :func:`plan` on one pod (``base_url``: its ops port, no trailing slash)
    with ``Authorization: Bearer <token>``; never raises (see the module invariants)."""
    if holding is None:
        return Replica(pod, error=NO_LORA)
    now = dict(holding)
    actions = plan(wanted, holding)
    if actions and token is None:
        return Replica(pod, tuple(sorted(now)), NO_KEY)
    headers = {"Authorization": f"Bearer {token}"}
    errors: list[str] = []
    stuck: set[str] = set()  # refused unloads: their reload's load would be refused too
    for action in actions:
        if action.name in stuck:
            continue
        path = LOAD_PATH if action.verb == "load" else UNLOAD_PATH
        try:
            response = await client.post(base_url + path, json=action.body(), headers=headers)
        except httpx.HTTPError as exc:
            errors.append(f"{action.verb} {action.name}: {type(exc).__name__}: {exc}")
            break
        if response.status_code != 200:
            errors.append(f"{action.verb} {action.name}: {response.status_code} {_cause(response)}")
            if action.verb == "unload":
                stuck.add(action.name)
        elif action.verb == "load":
            now[action.name] = str(action.path)
        else:
            now.pop(action.name, None)
    error = "; ".join(errors)[:ERROR_MAX] or None
    return Replica(pod, tuple(sorted(now)), error)


def replica_status(replica: Replica) -> dict[str, Any]:
    """One entry of ``status.adapters``."""
    entry: dict[str, Any] = {"pod": replica.pod, "adapters": list(replica.adapters)}
    if replica.error:
        entry["error"] = replica.error
    return entry
