"""``mmis operator``: run the MMInferenceService operator (kopf) in the foreground.

Invariants:
- With no ``--namespace`` the operator watches every namespace (needs the ClusterRole);
  with one or more it watches only those.
- Bad options exit with status 2 and a message, before any connection is made.
- Each option's default is its :class:`~mmis_operator.settings.Options` field's (the parser's
  are ``None``: an option left out keeps the field default).
- ``run`` returns 0 after a clean stop (SIGTERM/SIGINT, handled by kopf).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import sys

from mmis_operator.settings import Options


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
        "--liveness-endpoint", help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz"
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
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


def _priority(text: str | None) -> int | None:
    if text is None:
        return None
    if text == "random":
        return random.SystemRandom().randint(1, 2**30)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--priority must be an integer or 'random', got {text!r}") from None


def options_from_args(args: argparse.Namespace) -> Options:
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(Options)}
    given.update(namespaces=tuple(args.namespace), priority=_priority(args.priority))
    return Options(**{name: value for name, value in given.items() if value is not None})


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"mmis operator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from mmis_operator.kube import Kube  # imported late: `mmis --help` stays fast
    from mmis_operator.runner import serve

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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
