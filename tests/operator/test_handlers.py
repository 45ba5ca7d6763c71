from __future__ import annotations

import inspect
import re

import kopf
import kubernetes.client
import pytest

from mmis_operator import handlers
from mmis_operator.kube import Kube, KubeError
from mmis_operator.reconciler import ApplyError
from mmis_operator.spec import InvalidSpecError


def _raise(exc: Exception) -> None:
    raise exc


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (InvalidSpecError("spec.model", "set exactly one"), kopf.PermanentError),
        (ApplyError("rejected", permanent=True), kopf.PermanentError),
        (ApplyError("forbidden", permanent=False), kopf.TemporaryError),
        (KubeError(0, "connection refused"), kopf.TemporaryError),
    ],
)
def test_errors_map_to_permanent_or_temporary(error: Exception, expected: type) -> None:
    with pytest.raises(expected) as info:
        handlers._run(_raise, error)
    assert type(info.value) is expected


def test_handler_ids_are_valid_annotation_names() -> None:
    cfg = kubernetes.client.Configuration()
    cfg.host = "https://127.0.0.1:1"
    registry = handlers.build_registry(Kube(cfg))
    ids = {h.id for h in registry._changing.get_all_handlers()}
    ids |= {h.id for h in registry._spawning.get_all_handlers()}
    ids |= {h.id for h in registry._watching.get_all_handlers()}
    assert ids == {
        "reconcile",
        "reconcile/spec",
        "adapters/spec.adapters",
        "resync",
        "coherence",
        "deployment",
        "pod",
    }
    for handler_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_./]*", handler_id)


def test_event_handlers_and_the_reconcile_never_block_kopfs_loop_or_threads() -> None:
    """Child events only queue work (a coalesced refresh, ``reconciler.Refresher``; a pod that
    turned Ready, ``probe.CoherenceProbe.pod_seen``) and the reconcile awaits a worker thread:
    kopf's event loop and executor stay free (bench_operator)."""
    cfg = kubernetes.client.Configuration()
    cfg.host = "https://127.0.0.1:1"
    registry = handlers.build_registry(Kube(cfg))
    watching = {str(h.id): h.fn for h in registry._watching.get_all_handlers()}
    changing = {h.id: h.fn for h in registry._changing.get_all_handlers()}
    for fn in (watching["deployment"], watching["pod"], *changing.values()):
        assert inspect.iscoroutinefunction(fn), fn


def test_no_handler_makes_kopf_add_a_finalizer() -> None:
    """Deleting a resource must not wait for the operator (it may be uninstalled): no delete
    handler, and the timers registered without kopf's finalizer (tests/kube checks it live)."""
    cfg = kubernetes.client.Configuration()
    cfg.host = "https://127.0.0.1:1"
    registry = handlers.build_registry(Kube(cfg))
    spawning = registry._spawning.get_all_handlers()
    assert {h.id for h in spawning} == {"resync", "coherence"}
    assert not any(h.requires_finalizer for h in spawning)
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())


@pytest.mark.parametrize(
    ("api_key", "scheme", "token"),
    [({"BearerToken": "Bearer abc"}, "Bearer", "abc"), ({"authorization": "abc"}, None, "abc"),
     ({}, None, None)],
)  # fmt: skip
def test_connection_info_uses_the_token(
    api_key: dict[str, str], scheme: str | None, token: str | None
) -> None:
    cfg = kubernetes.client.Configuration()
    cfg.host = "https://10.0.0.1:6443"
    cfg.api_key = api_key
    info = handlers.connection_info(Kube(cfg))
    assert (info.server, info.scheme, info.token) == ("https://10.0.0.1:6443", scheme, token)
