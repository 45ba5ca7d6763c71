"""``mmis operator`` / ``mmis-operator``: run the MMInferenceService operator (kopf), in the
foreground or in a thread (tests, benchmarks).

Owns (each a section below): the operator's options (:class:`Options`) and the kopf settings
derived from them (:func:`configure`), the command line (``add_arguments``/``run``, the
``mmis operator`` subcommand, and :func:`main`, the ``mmis-operator`` console script: the
operator image's entry point), and running it (:func:`serve`, :class:`OperatorThread`).

Invariants:
- With no ``--namespace`` the operator watches every namespace (needs the ClusterRole);
  with one or more it watches only those.
- Bad options exit with status 2 and a message, before any connection is made.
- Each option's default is its :class:`Options` field's (the parser's are ``None``: an option
  left out keeps the field default).
- ``run`` returns 0 after a clean stop (SIGTERM/SIGINT, handled by kopf).
- Logs (:func:`setup_logging`): at INFO what changed and errors, never a line per successful
  handler or liveness GET; ``--log-level DEBUG`` shows those too. The liveness endpoint binds
  the address it names (the chart: the pod's IP, port 10280), never a port users forward to.
- Everything kopf stores on objects lives under ``mmis.dev``: handler progress and the
  last-handled spec as ``mmis.dev/...`` annotations; nothing is written into ``status`` by
  kopf. No handler needs a finalizer (``handlers._no_finalizer``): ``mmis.dev/finalizer``
  is only the name kopf looks for to remove it from resources an older operator finalized.
- Watches always have a server-side and a client-side timeout, and requests a timeout, so a
  restarted or silent API server never wedges the operator: watches re-establish themselves.
- Peering is off (standalone) unless a peering name is given; then a standby replica with a
  lower priority waits while the active one holds the peering object.
- One function, :func:`serve`, builds the registry, settings and client for both modes, so the
  threaded operator tests exercise exactly what ``mmis operator`` runs.
- What the chart's values grant and ask reach the reconciler as flags
  (:meth:`Options.security`): ``--picker-cluster-role`` (set with ``routing.enabled``),
  ``--encoders`` (``encoder.enabled``),
  ``--no-network-policies`` (``networkPolicy.enabled=false``), ``--network-policy-scrapers``
  (``networkPolicy.scrapers``, a NetworkPolicyPeer as JSON), ``--operator-pod-labels`` and the
  operator's namespace (``--operator-namespace``, else ``$POD_NAMESPACE``: the downward API),
  and ``--internal-key`` (``adapters.enabled``; else ``$MMIS_OPERATOR_INTERNAL_KEY``, which the
  chart sets from its Secret ``<fullname>-internal-key``).
- :class:`OperatorThread` stops through kopf's stop flag (no signals, no thread killing) and
  ``start`` returns only after kopf reports readiness (or raises if it died first).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import logging
import os
import random
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kopf

from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator.handlers import build_registry
from mmis_operator.kube import Kube
from mmis_operator.probe import CoherenceProbe
from mmis_operator.reconciler import Security

# --- Options and kopf settings (was settings.py) --------------------------------------------------

INTERNAL_KEY_ENV = "MMIS_OPERATOR_INTERNAL_KEY"  # --internal-key's value (the chart's Secret)


@dataclasses.dataclass(frozen=True)
class Options:
    namespaces: tuple[str, ...] = ()  # empty: cluster-wide
    peering: str | None = None
    priority: int = 0
    liveness_endpoint: str | None = None
    watch_server_timeout: int = 60  # sent as ?timeoutSeconds=, which must be an integer
    watch_client_timeout: float = 90.0
    connect_timeout: float = 10.0
    request_timeout: float = 60.0
    resync_seconds: float = 60.0
    workers: int | None = None
    event_level: int = logging.WARNING
    # the CacheCoherent probe: interval, per-pod HTTP timeout, and whether the test-only
    # ``mmis.dev/stats-endpoints`` annotation may redirect it (never in production)
    probe_seconds: float = 30.0
    probe_timeout: float = 2.0
    allow_stats_endpoint_override: bool = False
    # testing knobs in a resource (spec.engine.faultEvictRate) are refused unless this is set
    allow_fault_injection: bool = False
    # what the installation grants and asks (reconciler.Security): the picker's ClusterRole
    # it may bind (empty: spec.routing is refused), NetworkPolicies and who scrapes, and the
    # operator's own pods (admitted to the ops port; unknown out of cluster)
    picker_cluster_role: str = ""
    network_policies: bool = True
    network_policy_scrapers: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: copy.deepcopy(r.DEFAULT_SCRAPERS)
    )
    operator_namespace: str | None = None
    operator_pod_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # installed with encoder.enabled (it may create the internal token's Secret): spec.encoder
    # is built; otherwise refused (Encoders False, EncodersNotEnabled)
    encoders: bool = False
    # the chart's adapters.enabled: the key internal tokens are derived from (adapters.py),
    # so the operator can push spec.adapters to the pods; from --internal-key or, better (a
    # flag shows in the process list), INTERNAL_KEY_ENV; empty: no adapter reaches a pod
    internal_key: str = dataclasses.field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.watch_client_timeout <= self.watch_server_timeout:
            raise ValueError(
                "watch client timeout must exceed the server timeout "
                f"({self.watch_client_timeout} <= {self.watch_server_timeout})"
            )
        if self.resync_seconds <= 0:
            raise ValueError(f"resync interval must be positive, got {self.resync_seconds}")
        if self.probe_seconds <= 0 or self.probe_timeout <= 0:
            raise ValueError(
                f"probe interval and timeout must be positive, got {self.probe_seconds}, "
                f"{self.probe_timeout}"
            )

    def security(self) -> Security:
        return Security(
            picker_cluster_role=self.picker_cluster_role,
            network_policies=self.network_policies,
            scrapers=self.network_policy_scrapers,
            operator_namespace=self.operator_namespace,
            operator_labels=self.operator_pod_labels,
            encoders=self.encoders,
            internal_key=self.internal_key,
        )


def configure(settings: kopf.OperatorSettings, options: Options) -> kopf.OperatorSettings:
    """Apply ``options`` to ``settings`` (in place) and return it."""
    settings.persistence.finalizer = r.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=r.ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=r.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = int(options.watch_server_timeout)
    settings.watching.client_timeout = options.watch_client_timeout
    settings.watching.connect_timeout = options.connect_timeout
    settings.networking.request_timeout = options.request_timeout
    settings.networking.connect_timeout = options.connect_timeout
    settings.posting.level = options.event_level
    settings.posting.reporting_component = r.REPORTING_COMPONENT
    settings.peering.standalone = options.peering is None
    settings.peering.name = options.peering or "default"
    settings.peering.priority = options.priority
    settings.peering.clusterwide = not options.namespaces
    # a namespaced operator serves exactly its namespaces (no globs): without this, kopf
    # retries listing every namespace (which the chart's namespaced RBAC refuses) for
    # about a minute before it serves them anyway
    settings.scanning.disabled = bool(options.namespaces)
    if options.workers is not None:
        settings.execution.max_workers = options.workers
    return settings


# --- The command line (was main.py) ---------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)"
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable; default: all namespaces)",
    )
    parser.add_argument("--peering", help="kopf peering name: enables standby replicas")
    parser.add_argument(
        "--priority",
        help="peering priority, highest wins; 'random' gives each replica a distinct one "
        "(replicas with equal priorities all pause)",
    )
    parser.add_argument(
        "--liveness-endpoint",
        help="serve kopf's liveness probe, e.g. http://10.0.0.5:10280/healthz (the chart binds "
        "the pod's IP on operator.livenessPort, 10280: never a port a user picks for kubectl "
        "port-forward, never every address of a host-network node)",
    )
    parser.add_argument("--watch-server-timeout", type=int)
    parser.add_argument("--watch-client-timeout", type=float)
    parser.add_argument("--request-timeout", type=float)
    parser.add_argument("--resync-seconds", type=float)
    parser.add_argument("--probe-seconds", type=float, help="CacheCoherent: probe pods this often")
    parser.add_argument("--probe-timeout", type=float, help="CacheCoherent: per-pod HTTP timeout")
    parser.add_argument("--workers", type=int, help="worker threads: reconciles, status refreshes")
    parser.add_argument(
        "--allow-fault-injection",
        action="store_const",
        const=True,
        help="let resources set testing knobs (spec.engine.faultEvictRate); refused otherwise",
    )
    parser.add_argument(
        "--picker-cluster-role",
        metavar="NAME",
        help="the endpoint picker's ClusterRole (the chart's, with routing.enabled) that the "
        "operator binds per resource; unset, spec.routing is refused (Routing False, "
        "RoutingNotEnabled)",
    )
    parser.add_argument(
        "--encoders",
        action="store_const",
        const=True,
        help="build spec.encoder (the chart's encoder.enabled, which lets the operator create "
        "the internal token's Secret); unset, spec.encoder is refused (Encoders False, "
        "EncodersNotEnabled)",
    )
    parser.add_argument(
        "--internal-key",
        metavar="KEY",
        help="the key each resource's internal token is derived from (HMAC-SHA256 of "
        "NAMESPACE/NAME/UID), so the operator can push spec.adapters to the pods' /internal/* "
        f"routes; prefer the environment ({INTERNAL_KEY_ENV}, the chart's adapters.enabled "
        "sets it from the Secret <fullname>-internal-key); unset, spec.adapters is loaded "
        "nowhere and status.adapters says so",
    )
    parser.add_argument(
        "--no-network-policies",
        dest="network_policies",
        action="store_const",
        const=False,
        help="render no NetworkPolicies (and delete the ones rendered before)",
    )
    parser.add_argument(
        "--network-policy-scrapers",
        type=_peer,
        metavar="JSON",
        help="who scrapes the pods' metrics, a NetworkPolicyPeer "
        '(default: {"namespaceSelector": {}, "podSelector": {"matchLabels": '
        '{"app.kubernetes.io/name": "prometheus"}}})',
    )
    parser.add_argument(
        "--operator-namespace",
        help="the operator's own namespace, admitted to the pods' ops port with "
        "--operator-pod-labels (default: $POD_NAMESPACE)",
    )
    parser.add_argument(
        "--operator-pod-labels",
        type=_labels,
        metavar="KEY=VALUE,...",
        help="the operator's own pods' labels (the chart's selector labels)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


_PEER_KEYS = ("namespaceSelector", "podSelector")


def _peer(text: str) -> dict[str, Any]:
    """A NetworkPolicyPeer of selectors as JSON (``ipBlock`` is no scraper's identity)."""
    try:
        peer = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(peer, dict) or not peer or set(peer) - set(_PEER_KEYS):
        raise argparse.ArgumentTypeError(
            f"must be an object with {' and/or '.join(_PEER_KEYS)}, got {text!r}"
        )
    if not all(isinstance(v, dict) for v in peer.values()):
        raise argparse.ArgumentTypeError(f"each selector must be an object, got {text!r}")
    return peer


def _labels(text: str) -> dict[str, str]:
    labels = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        labels[key.strip()] = value.strip()
    return labels


def _priority(text: str | None) -> int | None:
    if text is None:
        return None
    if text == "random":
        return random.SystemRandom().randint(1, 2**30)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--priority must be an integer or 'random', got {text!r}") from None


def liveness_url(endpoint: str | None) -> str | None:
    """``--liveness-endpoint`` as kopf parses it: ``http://HOST:PORT/PATH``, with a bare IPv6
    host bracketed (the chart passes ``http://$(POD_IP):PORT/healthz``, and a pod IP may be
    IPv6); anything else is a ValueError naming the flag."""
    if endpoint is None:
        return None
    scheme, sep, rest = endpoint.partition("://")
    netloc, slash, path = rest.partition("/")
    host, colon, port = netloc.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    if scheme != "http" or not sep or not host or not colon or not port.isdigit():
        raise ValueError(f"--liveness-endpoint must be http://HOST:PORT/PATH, got {endpoint!r}")
    return f"http://{host}:{port}{slash}{path}"


def options_from_args(args: argparse.Namespace) -> Options:
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(Options)}
    given["liveness_endpoint"] = liveness_url(given.get("liveness_endpoint"))
    given.update(namespaces=tuple(args.namespace), priority=_priority(args.priority))
    if given.get("operator_namespace") is None:  # the downward API (the chart sets it)
        given["operator_namespace"] = os.environ.get("POD_NAMESPACE") or None
    if given.get("internal_key") is None:  # the chart: secretKeyRef, never a flag
        given["internal_key"] = os.environ.get(INTERNAL_KEY_ENV) or None
    return Options(**{name: value for name, value in given.items() if value is not None})


# loggers whose INFO lines are no change: kopf's "Handler ... succeeded." / "... is processed"
# for every reconcile, resync and probe tick, and aiohttp's access line for every liveness GET
CHATTY_LOGGERS = ("kopf.objects", "aiohttp.access")


def setup_logging(level: str) -> None:
    """The operator's log at ``level``: above DEBUG it says what changed (objects created,
    updated or deleted, condition transitions, errors), not each successful no-op handler or
    probe GET (:data:`CHATTY_LOGGERS` then log warnings and errors only)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet = logging.getLevelName(level) > logging.DEBUG
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"mmis operator: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    kube = Kube.from_kubeconfig(args.kubeconfig)
    try:
        asyncio.run(serve(kube, options))
    finally:
        kube.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``mmis-operator`` console script (the operator image's entry point)."""
    parser = argparse.ArgumentParser(
        prog="mmis-operator", description="run the MMInferenceService operator (kopf)"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


# --- Running the operator: foreground or a thread (was runner.py) ---------------------------------


async def serve(
    kube: Kube,
    options: Options,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
) -> None:
    settings = configure(kopf.OperatorSettings(), options)
    if options.workers is not None:  # the reconciles and status refreshes (asyncio.to_thread)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(options.workers, thread_name_prefix="mmis-operator")
        )
    await kopf.operator(
        registry=build_registry(
            kube,
            options.resync_seconds,
            CoherenceProbe(
                kube,
                options.probe_timeout,
                options.allow_stats_endpoint_override,
                options.internal_key,
            ),
            options.probe_seconds,
            options.allow_fault_injection,
            security=options.security(),
        ),
        settings=settings,
        clusterwide=not options.namespaces,
        namespaces=list(options.namespaces),
        liveness_endpoint=options.liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


class OperatorThread:
    """The operator in a background thread with its own event loop and credentials."""

    def __init__(self, kubeconfig: Path | str, options: Options) -> None:
        self.kube = Kube.from_kubeconfig(kubeconfig)
        self.options = options
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mmis-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(serve(self.kube, self.options, self.stop_flag, self.ready_flag))
        except BaseException as exc:  # reported by start()/stop()
            self.error = exc
        finally:
            self.ready_flag.set()  # unblock start() if kopf died before becoming ready

    def start(self, timeout: float = 60.0) -> OperatorThread:
        self._thread.start()
        if not self.ready_flag.wait(timeout):
            raise TimeoutError(f"the operator was not ready within {timeout}s")
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the operator stopped during start-up: {self.error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_flag.set()
        self._thread.join(timeout)
        self.kube.close()
        if self._thread.is_alive():
            raise TimeoutError(f"the operator did not stop within {timeout}s")

    def __enter__(self) -> OperatorThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
