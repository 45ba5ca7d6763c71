"""The kopf handlers: thin adapters from kopf causes to :class:`Reconciler` calls.

Invariants:
- Handlers are registered on a fresh ``kopf.OperatorRegistry`` per operator, never on kopf's
  global registry, so tests can run several operators (different credentials) in one process.
- A spec the operator can never run (InvalidSpecError, a manifest the API server rejects)
  becomes ``kopf.PermanentError``: no retry loop; the next spec change is handled normally.
- A transient failure (API server down, RBAC being fixed) becomes ``kopf.TemporaryError``
  with a delay, so kopf retries without a crash.
- Handlers return None: kopf stores nothing in ``status``; all status is ours.
- The coherence timer and a change of ``spec.adapters`` run the same probe cycle
  (:meth:`CoherenceProbe.run`: CacheCoherent, and the adapters pushed to the ready pods).
- No handler needs a finalizer, so deleting a resource never waits for the operator (an
  uninstalled operator included): children go by garbage collection (owner references), and
  the timers are registered without kopf's finalizer (``_no_finalizer``); a finalizer left by
  an older operator is removed by kopf on its first look at the object.
- Deployment and pod events of managed children never call the API on kopf's event loop nor
  hold one of kopf's worker threads: they hand the newest body to a per-resource coalescing
  :class:`~mmis_operator.reconciler.Refresher` (``Reconciler.deployment_changed`` /
  ``pod_changed`` run once per burst, ``refresh_delay`` seconds after its first event).
  The reconcile runs in a worker thread too (``asyncio.to_thread``); its status write and the
  refreshes' are serialized per resource, each reading the Deployment as it is then
  (``Reconciler.refresh_status``), so a write never lands after a newer one.
- A pod that turns Ready also gets ``spec.adapters`` at once (``CoherenceProbe.pod_seen``,
  once per Ready spell, no API call on the loop: the probe's own per-resource task pushes
  with the cycle's sync, its API calls in worker threads), not at the next probe tick.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import kopf

from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator.kube import Kube, KubeError
from mmis_operator.probe import CoherenceProbe
from mmis_operator.reconciler import ApplyError, Reconciler, Refresher, Security
from mmis_operator.spec import InvalidSpecError, parse_spec

RETRY_DELAY = 5.0


def _run(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except InvalidSpecError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except ApplyError as exc:
        if exc.permanent:
            raise kopf.PermanentError(str(exc)) from exc
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY) from exc
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY) from exc


def build_registry(
    kube: Kube,
    resync_seconds: float = 60.0,
    probe: CoherenceProbe | None = None,
    probe_seconds: float = 30.0,
    allow_fault_injection: bool = False,
    refresh_delay: float = 0.2,
    security: Security | None = None,
) -> kopf.OperatorRegistry:
    """Register every handler of the operator on a new registry bound to ``kube``."""
    registry = kopf.OperatorRegistry()
    reconciler = Reconciler(kube, allow_fault_injection, security=security)
    refresher = Refresher(refresh_delay)
    resource = (r.GROUP, r.VERSION, r.PLURAL)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(kube)

    @kopf.on.resume(*resource, id="reconcile", registry=registry)
    @kopf.on.create(*resource, id="reconcile", registry=registry)
    @kopf.on.update(*resource, id="reconcile", field="spec", registry=registry)
    async def reconcile(body: kopf.Body, **_: Any) -> None:
        await asyncio.to_thread(_run, reconciler.reconcile, _plain(body))

    @kopf.timer(
        *resource,
        id="resync",
        interval=resync_seconds,
        initial_delay=resync_seconds,
        registry=registry,
    )
    def resync(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        try:
            reconciler.reconcile(_plain(body))
        except (InvalidSpecError, ApplyError, KubeError) as exc:
            logger.debug("resync of %s: %s", body.metadata.name, exc)  # status already says it

    coherence_probe = probe or CoherenceProbe(kube)

    @kopf.timer(
        *resource,
        id="coherence",
        interval=probe_seconds,
        initial_delay=probe_seconds,
        registry=registry,
    )
    async def coherence(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        await probe_cycle(body, logger)

    # a changed spec.adapters reaches the ready pods now, not at the next probe tick
    @kopf.on.update(*resource, id="adapters", field="spec.adapters", registry=registry)
    async def adapters_changed(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        await probe_cycle(body, logger)

    async def probe_cycle(body: kopf.Body, logger: kopf.Logger) -> None:
        plain = _plain(body)
        try:
            spec = parse_spec(plain.get("spec") or {})
            await coherence_probe.run(plain, spec.cache.drift_threshold, spec.adapters)
        except (InvalidSpecError, KubeError) as exc:  # Degraded says the first; next tick retries
            logger.debug("coherence probe of %s: %s", body.metadata.name, exc)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        id="deployment",
        labels={r.LABEL_MANAGED_BY: r.MANAGED_BY},
        registry=registry,
    )
    async def deployment_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        # type None: a (re-)listing. kopf lists again after every broken watch (API server
        # restart, 410 Gone), and changes made while the watch was down arrive only that way,
        # so they refresh the status too (an unchanged status is not rewritten).
        key = _owner(body)
        if key is not None:
            plain, deleted = _plain(body), type == "DELETED"
            refresher.submit_deployment(
                key, lambda: reconciler.deployment_changed(plain, deleted=deleted)
            )

    @kopf.on.event(
        "", "v1", "pods", id="pod", labels={r.LABEL_MANAGED_BY: r.MANAGED_BY}, registry=registry
    )
    async def pod_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        key = _owner(body)
        if key is None:
            return
        plain, deleted = _plain(body), type == "DELETED"
        coherence_probe.pod_seen(key, plain, deleted)  # turned Ready: the adapters, now
        if not deleted:  # on DELETED the Deployment's events follow
            refresher.submit_pod(key, body.metadata.name, lambda: reconciler.pod_changed(plain))

    _no_finalizer(registry)
    return registry


def _no_finalizer(registry: kopf.OperatorRegistry) -> None:
    """kopf gives every timer a finalizer (to stop it before the object goes). Ours tolerate a
    vanished object (status writes to a gone resource are skipped), so deletion is not held
    for them: without a finalizer, a resource is deleted even with no operator running."""
    spawning = registry._spawning  # kopf has no public switch for this (tested)
    spawning._handlers = [
        dataclasses.replace(h, requires_finalizer=False) for h in spawning._handlers
    ]


def _owner(body: kopf.Body) -> tuple[str, str] | None:
    """The (namespace, name) of the MMInferenceService a managed child belongs to."""
    owner = body.metadata.labels.get(r.LABEL_SERVICE)
    return (body.metadata.namespace, owner) if owner and body.metadata.namespace else None


def _plain(body: kopf.Body) -> dict[str, Any]:
    return {key: body[key] for key in body}


def connection_info(kube: Kube) -> kopf.ConnectionInfo:
    """kopf's connection from the same configuration the reconciler uses."""
    cfg = kube.configuration
    key = cfg.get_api_key_with_prefix
    auth = key("BearerToken") or key("authorization") or ""
    scheme, _, token = auth.rpartition(" ")  # "Bearer abc" -> "Bearer", "abc"; "abc" -> "", "abc"
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )
