"""The coherence probe: fetch each ready pod's ``/stats/cache``, store ``CacheCoherent``.

One cycle (:meth:`CoherenceProbe.run`, called by the operator's ``coherence`` timer): list the
service's pods, GET ``http://<podIP>:8001/stats/cache`` (the front end's operations port,
never exposed by the Service, no API key) on each ready one concurrently, judge
the answers (:func:`mmis_operator.status.evaluate`) and write ``status.cache`` plus the
``CacheCoherent`` condition, posting one Event per status flip.

Invariants:
- Every HTTP probe has a short timeout; a pod that does not answer is a failed probe for this
  cycle, never a hung timer or an exception out of the cycle.
- The endpoint override (annotation ``mmis.dev/stats-endpoints: "http://h:p,..."``, the i-th
  endpoint standing in for the i-th ready pod by name) is honoured only when the operator was
  started with ``allow_endpoint_override``; otherwise it is ignored, so a resource's author
  cannot point the operator at arbitrary URLs in production.
- The status write (:func:`status.write`: fresh read, 409 -> retry) touches only
  ``status.cache``, ``status.encoderFallbacksPerMinute`` and the ``CacheCoherent`` condition:
  Ready/Progressing/Degraded survive, and ``CacheCoherent`` never feeds ``Ready``.
- With ``spec.encoder`` the same cycle also GETs each ready pod's ``/metrics`` (same port,
  same timeout) and sums P0's ``mmis_encoder_fallbacks_total``; the rate per minute over the
  pods answering in this cycle and the previous one (kept in memory per resource, so it
  needs two cycles after the operator starts) is ``status.encoderFallbacksPerMinute``. A pod
  that does not answer is left out of the rate; with no pod sampled twice the field is left as
  it is. Without ``spec.encoder`` nothing more is fetched.
- With ``spec.adapters`` the same cycle brings each ready pod's LoRA adapters to the spec's
  list (:mod:`mmis_operator.adapters`: the pod's holdings read from the ``/stats/cache`` answer
  it already fetched, then P0's ``/internal/*`` LoRA routes on the same ops port with the
  derived internal token) and writes ``status.adapters`` in the same status write; without it
  ``status.adapters`` is removed and no pod is called. The cycle also runs on a change of
  ``spec.adapters`` (``handlers``), so a change lands within seconds; cycles of one resource
  never overlap (a lock per resource), and a cycle that ran on a list already replaced is
  repaired by the next one.
- A pod that turns Ready (a scale-up, a restarted pod, a rolling update) gets the adapters
  within seconds, not at the next tick: the operator's pod events feed
  :meth:`CoherenceProbe.pod_seen` (on the event loop, no API call), which queues the pod once
  per Ready spell (:class:`Arrivals`: the pod's uid and its Ready condition's
  ``lastTransitionTime``, so further events of a Ready pod queue nothing and a pod Ready again
  after a restart is queued again); one task per resource drains the queue with
  :meth:`CoherenceProbe.push`, the cycle's own fetch and :func:`sync_adapters` on just those
  pods, under the resource's lock, its API calls in worker threads. The push re-reads the
  resource inside the lock, so it never undoes a ``spec.adapters`` change synced meanwhile,
  and writes only its pods' ``status.adapters`` entries (:func:`with_replicas`). A failed
  push is retried by the next tick, as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import ssl
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import httpx

from mmis_operator import adapters, status
from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator.kube import Kube, KubeError, service_path
from mmis_operator.spec import AdapterSpec, InvalidSpecError, parse_spec

logger = logging.getLogger(__name__)
OVERRIDE_ANNOTATION = f"{r.GROUP}/stats-endpoints"
STATS_PATH = "/stats/cache"
ADAPTERS_STATUS = "adapters"  # status.adapters: per replica {pod, adapters, error?}
METRICS_PATH = "/metrics"


Key = tuple[str, str]  # (namespace, resource name)


@dataclasses.dataclass(frozen=True)
class Target:
    pod: str
    url: str


def _ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    pod_status = pod.get("status") or {}
    ready = status.find(pod_status.get("conditions") or (), "Ready")
    return bool(pod_status.get("podIP")) and ready is not None and ready.get("status") == "True"


def ready_since(pod: Mapping[str, Any]) -> str | None:
    """When the pod's current Ready spell began (its Ready condition's ``lastTransitionTime``,
    "" when unset), or None when the pod is not ready (:func:`_ready`)."""
    if not _ready(pod):
        return None
    ready = status.find(pod["status"]["conditions"], "Ready") or {}
    return str(ready.get("lastTransitionTime") or "")


def _who(pod: Mapping[str, Any]) -> str:
    return str(pod["metadata"].get("uid") or pod["metadata"]["name"])


class Arrivals:
    """Which pods turned Ready since last seen: :meth:`arrived` is True once per Ready spell
    (a pod's uid and :func:`ready_since`).

    Pure state, on the event loop only. kopf may batch a pod's events (only the newest of a
    burst reaches the handler), so a Ready -> not ready -> Ready flap inside one batch is seen
    by the Ready condition's new ``lastTransitionTime``; a spell is forgotten when the pod is
    seen not ready or deleted, so the memory holds one short string per ready pod."""

    def __init__(self) -> None:
        self._spells: dict[str, str] = {}  # pod uid (or name) -> its Ready spell already seen

    def arrived(self, pod: Mapping[str, Any]) -> bool:
        who, since = _who(pod), ready_since(pod)
        if since is None:
            self._spells.pop(who, None)
            return False
        if self._spells.get(who) == since:
            return False
        self._spells[who] = since
        return True

    def forget(self, pod: Mapping[str, Any]) -> None:
        self._spells.pop(_who(pod), None)


def with_replicas(
    current: Sequence[Mapping[str, Any]], fresh: Sequence[Mapping[str, Any]], ready: Collection[str]
) -> list[dict[str, Any]]:
    """``status.adapters`` after a push: ``fresh``'s entries replace those of their pods, the
    other entries of pods still in ``ready`` are kept, the rest dropped; sorted by pod (as a
    cycle writes them)."""
    entries = {str(e["pod"]): dict(e) for e in current if e.get("pod") in ready}
    entries.update({str(e["pod"]): dict(e) for e in fresh})
    return [entries[pod] for pod in sorted(entries)]


def targets(
    body: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], allow_override: bool
) -> list[Target]:
    """The URLs to probe: one per ready pod (sorted by name), or the override's endpoints."""
    ready = sorted((p for p in pods if _ready(p)), key=lambda p: str(p["metadata"]["name"]))
    annotations = body.get("metadata", {}).get("annotations") or {}
    override = annotations.get(OVERRIDE_ANNOTATION)
    if override and allow_override:
        endpoints = [e.strip().rstrip("/") for e in str(override).split(",") if e.strip()]
        return [
            Target(p["metadata"]["name"], e + STATS_PATH)
            for p, e in zip(ready, endpoints, strict=False)
        ]
    if override:
        logger.warning("ignoring %s: endpoint overrides are not allowed", OVERRIDE_ANNOTATION)
    return [
        Target(p["metadata"]["name"], f"http://{p['status']['podIP']}:{r.OPS_PORT}{STATS_PATH}")
        for p in ready
    ]


async def _fetch(client: httpx.AsyncClient, target: Target) -> status.ProbeResult:
    try:
        response = await client.get(target.url)
        response.raise_for_status()
        answer = response.json()
        stats = status.parse_stats(answer)
        lora = adapters.held(answer)
    except httpx.HTTPError as exc:
        return status.ProbeResult(target.pod, error=f"{type(exc).__name__}: {exc}"[:200])
    except ValueError as exc:  # bad JSON or a StatsError
        return status.ProbeResult(target.pod, error=f"bad answer: {exc}"[:200])
    return status.ProbeResult(target.pod, stats=stats, lora=lora)


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every cycle: building one loads the CA bundle, 0.1-0.3 s of CPU that
    a fresh client per cycle spent on the operator's event loop (every resource, every
    interval), stalling all of kopf's watches (benchmarks/README.md, operator speed)."""
    return httpx.create_ssl_context()


async def fetch_all(found: Sequence[Target], timeout: float) -> list[status.ProbeResult]:
    """Probe every target concurrently, each bounded by ``timeout`` seconds."""
    if not found:
        return []
    tls = _tls()
    async with httpx.AsyncClient(
        timeout=timeout, follow_redirects=False, trust_env=False, verify=tls
    ) as c:
        return list(await asyncio.gather(*(_fetch(c, t) for t in found)))


async def _fetch_fallbacks(client: httpx.AsyncClient, target: Target) -> float | None:
    url = target.url.removesuffix(STATS_PATH) + METRICS_PATH
    try:
        response = await client.get(url)
        response.raise_for_status()
        return status.fallbacks_total(response.text)
    except (httpx.HTTPError, status.StatsError) as exc:
        logger.debug("encoder fallbacks of %s: %s", target.pod, exc)
        return None


async def fetch_fallbacks(found: Sequence[Target], timeout: float) -> dict[str, float]:
    """Pod -> its front end's ``mmis_encoder_fallbacks_total`` (every reason summed), for the
    pods that answered ``GET /metrics`` within ``timeout`` seconds."""
    if not found:
        return {}
    async with httpx.AsyncClient(
        timeout=timeout, follow_redirects=False, trust_env=False, verify=_tls()
    ) as c:
        answers = await asyncio.gather(*(_fetch_fallbacks(c, t) for t in found))
    return {t.pod: v for t, v in zip(found, answers, strict=True) if v is not None}


async def sync_adapters(
    found: Sequence[Target],
    results: Sequence[status.ProbeResult],
    wanted: Sequence[AdapterSpec],
    token: str | None,
    timeout: float,
) -> list[adapters.Replica]:
    """Bring every probed pod to ``wanted`` (concurrently, each call bounded by ``timeout``);
    a pod whose probe failed is reported with that failure and not called."""
    async with httpx.AsyncClient(
        timeout=timeout, follow_redirects=False, trust_env=False, verify=_tls()
    ) as c:

        async def one(target: Target, result: status.ProbeResult) -> adapters.Replica:
            if result.error is not None:
                return adapters.Replica(target.pod, error=f"{STATS_PATH}: {result.error}")
            base = target.url.removesuffix(STATS_PATH)
            return await adapters.sync_pod(c, target.pod, base, token, wanted, result.lora)

        return list(await asyncio.gather(*(one(t, p) for t, p in zip(found, results, strict=True))))


class CoherenceProbe:
    """One operator's probe: its Kube client, HTTP timeout, override permission and internal
    key (None: no token to call the pods' ``/internal/*`` routes with)."""

    def __init__(
        self,
        kube: Kube,
        timeout: float = 2.0,
        allow_override: bool = False,
        internal_key: str | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"probe timeout must be positive, got {timeout}")
        self.kube = kube
        self.timeout = timeout
        self.allow_override = allow_override
        self.internal_key = internal_key or None
        self._locks: dict[Key, asyncio.Lock] = {}
        self.arrivals = Arrivals()
        self._arrived: dict[Key, set[str]] = {}  # per resource: pods waiting for a push
        self._pushes: dict[Key, asyncio.Task[None]] = {}  # per resource: the task draining it
        # per resource: pod -> (monotonic seconds, fallbacks total) of the last cycle
        self._fallbacks: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
        self.clock = time.monotonic

    def list_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{namespace}/pods"
        found = self.kube.request("GET", path, query={"labelSelector": r.selector_string(name)})
        return list(found.get("items") or [])

    async def run(
        self,
        body: Mapping[str, Any],
        threshold: float,
        wanted: Sequence[AdapterSpec] | None = None,
    ) -> status.Coherence:
        """Probe, judge, sync ``wanted`` (the parsed ``spec.adapters``; None: absent) and
        store; returns what was stored."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        async with self._locks.setdefault(key, asyncio.Lock()):
            pods = await asyncio.to_thread(self.list_pods, meta["namespace"], meta["name"])
            found = targets(body, pods, self.allow_override)
            results = await fetch_all(found, self.timeout)
            judged = status.evaluate(results, threshold)
            rate = None
            if (body.get("spec") or {}).get("encoder") is not None:
                rate = await self.fallback_rate(key, found)
            else:
                self._fallbacks.pop(key, None)
            held = None
            if wanted is not None:
                token = self.token(meta)
                replicas = await sync_adapters(found, results, wanted, token, self.timeout)
                held = [adapters.replica_status(one) for one in replicas]
            await asyncio.to_thread(self.store, *key, judged, rate, held)
            return judged

    def pod_seen(self, key: Key, pod: Mapping[str, Any], deleted: bool = False) -> None:
        """An event of a pod of resource ``key`` (call on the event loop; no API call here): a
        pod that turned Ready is queued for :meth:`push`, once per Ready spell."""
        if deleted:
            self.arrivals.forget(pod)
        elif self.arrivals.arrived(pod):
            self._arrived.setdefault(key, set()).add(str(pod["metadata"]["name"]))
            if key not in self._pushes:
                self._pushes[key] = asyncio.get_running_loop().create_task(self._drain(key))

    async def _drain(self, key: Key) -> None:
        try:
            while pods := self._arrived.pop(key, None):
                try:
                    await self.push(*key, pods)
                except (InvalidSpecError, KubeError) as exc:  # the next tick retries
                    logger.debug("adapters push to %s of %s/%s: %s", sorted(pods), *key, exc)
                except Exception:  # a bug: say so, keep the operator running
                    logger.exception("adapters push to %s of %s/%s", sorted(pods), *key)
        finally:  # no await since the empty pop: a pod queued meanwhile started a new task
            self._pushes.pop(key, None)

    async def idle(self) -> None:
        """Wait until every queued push has run (tests)."""
        while self._pushes:
            await asyncio.gather(*list(self._pushes.values()), return_exceptions=True)

    async def push(
        self, namespace: str, name: str, pods: Collection[str]
    ) -> list[adapters.Replica]:
        """Bring ``pods`` (those still ready) to the resource's ``spec.adapters`` now, with the
        cycle's own fetch and sync, and store their ``status.adapters`` entries; nothing
        without ``spec.adapters``. Returns the pods' outcomes."""
        key = (namespace, name)
        async with self._locks.setdefault(key, asyncio.Lock()):
            body = await asyncio.to_thread(self.kube.get, service_path(namespace, name))
            if body is None or body["metadata"].get("deletionTimestamp"):
                return []
            wanted = parse_spec(body.get("spec") or {}).adapters
            if wanted is None:
                return []
            listed = await asyncio.to_thread(self.list_pods, namespace, name)
            ready = targets(body, listed, self.allow_override)
            found = [t for t in ready if t.pod in pods]
            if not found:
                return []
            results = await fetch_all(found, self.timeout)
            token = self.token(body["metadata"])
            replicas = await sync_adapters(found, results, wanted, token, self.timeout)
            entries = [adapters.replica_status(one) for one in replicas]
            names = {t.pod for t in ready}
            await asyncio.to_thread(self.store_adapters, namespace, name, entries, names)
            return replicas

    def store_adapters(
        self, namespace: str, name: str, entries: list[dict[str, Any]], ready: Collection[str]
    ) -> None:
        """Write ``entries`` into ``status.adapters`` (:func:`with_replicas`), nothing else."""

        def compute(obj: Mapping[str, Any]) -> status.DesiredStatus:
            current = (obj.get("status") or {}).get(ADAPTERS_STATUS) or []
            return status.DesiredStatus(
                {ADAPTERS_STATUS: with_replicas(current, entries, ready)}, ()
            )

        status.write(self.kube, namespace, name, compute)

    def token(self, meta: Mapping[str, Any]) -> str | None:
        """The resource's internal token, derived from the operator's key (None: no key)."""
        if self.internal_key is None:
            return None
        namespace, name = meta["namespace"], meta["name"]
        return adapters.internal_token(self.internal_key, namespace, name, str(meta.get("uid")))

    async def fallback_rate(self, key: tuple[str, str], found: Sequence[Target]) -> float | None:
        """Encoder fallbacks per minute of resource ``key``'s pods since the last cycle."""
        totals = await fetch_fallbacks(found, self.timeout)
        now = self.clock()
        sampled = {pod: (now, total) for pod, total in totals.items()}
        before = self._fallbacks.get(key, {})
        self._fallbacks[key] = sampled
        return status.fallbacks_per_minute(before, sampled)

    def store(
        self,
        namespace: str,
        name: str,
        judged: status.Coherence,
        rate: float | None = None,
        held: list[dict[str, Any]] | None = None,
    ) -> None:
        """Write ``status.cache`` and ``CacheCoherent`` (an Event when its status flips),
        when known ``status.encoderFallbacksPerMinute``, and ``status.adapters`` (``held``;
        None removes it: no ``spec.adapters``)."""
        fields: dict[str, Any] = {"cache": judged.cache, ADAPTERS_STATUS: held}
        if rate is not None:
            fields[status.ENCODER_FALLBACKS] = rate
        update = status.DesiredStatus(fields, (judged.condition,))
        status.write(self.kube, namespace, name, lambda _: update)
