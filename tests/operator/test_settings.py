from __future__ import annotations

import argparse
import logging

import kopf
import pytest

from mmis.cli import main as cli_main
from mmis_operator import main as operator_main


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_everything_kopf_stores_is_under_mmis_dev() -> None:
    got = operator_main.configure(kopf.OperatorSettings(), operator_main.Options())
    assert got.persistence.finalizer == "mmis.dev/finalizer"
    progress = got.persistence.progress_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert progress.prefix == "mmis.dev"
    diffbase = got.persistence.diffbase_storage
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert diffbase.prefix == "mmis.dev"
    assert got.posting.level == logging.WARNING


def test_watch_timeouts_and_peering_from_the_command_line() -> None:
    args = _parse(
        "--namespace",
        "a",
        "--namespace",
        "b",
        "--peering",
        "mmis",
        "--priority",
        "7",
        "--watch-server-timeout",
        "30",
        "--watch-client-timeout",
        "45",
    )
    options = operator_main.options_from_args(args)
    assert options.namespaces == ("a", "b")
    got = operator_main.configure(kopf.OperatorSettings(), options)
    assert got.watching.server_timeout == 30
    assert isinstance(got.watching.server_timeout, int)  # the API server rejects 30.0
    assert got.watching.client_timeout == 45
    assert got.peering.standalone is False
    assert got.peering.name == "mmis"
    assert got.peering.priority == 7
    assert got.peering.clusterwide is False


def test_default_is_standalone_and_clusterwide() -> None:
    got = operator_main.configure(
        kopf.OperatorSettings(), operator_main.options_from_args(_parse())
    )
    assert got.peering.standalone is True
    assert got.peering.clusterwide is True
    assert got.watching.server_timeout is not None
    assert got.watching.client_timeout is not None


def test_client_timeout_must_exceed_server_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["operator", "--watch-server-timeout", "60", "--watch-client-timeout", "30"])
    assert code == 2
    assert "watch client timeout must exceed" in capsys.readouterr().err


def test_options_have_one_default_the_dataclass_field() -> None:
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    # --namespace appends to a fresh list; --log-level is no Options field (its one home)
    own = {
        a.dest: a.default
        for a in parser._actions
        if a.dest not in ("help", "namespace", "log_level") and a.default is not None
    }
    assert not own, f"operator options with a default besides Options': {own}"
    assert operator_main.options_from_args(_parse()) == operator_main.Options()
    assert operator_main.options_from_args(_parse("--probe-seconds", "5")).probe_seconds == 5.0


def test_fault_injection_needs_the_explicit_flag() -> None:
    assert operator_main.options_from_args(_parse()).allow_fault_injection is False
    allowed = operator_main.options_from_args(_parse("--allow-fault-injection"))
    assert allowed.allow_fault_injection is True


def test_security_flags_reach_the_reconciler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's routing.enabled / networkPolicy values arrive as flags (charts/mmis
    deployment.yaml); the namespace from the downward API's POD_NAMESPACE."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    plain = operator_main.options_from_args(_parse()).security()
    assert (plain.picker_cluster_role, plain.network_policies) == ("", True)
    assert plain.scrapers == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    assert plain.operator_peer() is None  # out of cluster: unknown
    monkeypatch.setenv("POD_NAMESPACE", "mmis-system")
    scrapers = '{"namespaceSelector": {"matchLabels": {"team": "obs"}}}'
    args = _parse(
        "--picker-cluster-role", "rel-mmis-operator-picker", "--no-network-policies",
        "--network-policy-scrapers", scrapers,
        "--operator-pod-labels",
        "app.kubernetes.io/name=mmis-operator,app.kubernetes.io/instance=rel",
    )  # fmt: skip
    got = operator_main.options_from_args(args).security()
    assert got.picker_cluster_role == "rel-mmis-operator-picker"
    assert got.network_policies is False
    assert got.scrapers == {"namespaceSelector": {"matchLabels": {"team": "obs"}}}
    assert got.operator_peer() == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mmis-system"}},
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "mmis-operator",
                "app.kubernetes.io/instance": "rel",
            }
        },
    }


@pytest.mark.parametrize(
    "flag",
    [
        ("--network-policy-scrapers", "not json"),
        ("--network-policy-scrapers", '{"ipBlock": {"cidr": "0.0.0.0/0"}}'),
        ("--network-policy-scrapers", '{"podSelector": "prometheus"}'),
        ("--operator-pod-labels", "no-equals-sign"),
    ],
)
def test_bad_security_flags_exit_2(
    flag: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["operator", *flag])
    assert exited.value.code == 2
    assert flag[0] in capsys.readouterr().err


def test_liveness_endpoint_brackets_an_ipv6_pod_ip_and_refuses_garbage() -> None:
    """The chart passes ``http://$(POD_IP):10280/healthz``; an IPv6 pod IP needs brackets."""
    url = operator_main.liveness_url
    assert url("http://10.1.2.3:10280/healthz") == "http://10.1.2.3:10280/healthz"
    assert url("http://fd00::7:10280/healthz") == "http://[fd00::7]:10280/healthz"
    assert url("http://[fd00::7]:10280/healthz") == "http://[fd00::7]:10280/healthz"
    assert operator_main.options_from_args(_parse()).liveness_endpoint is None
    for bad in ("10.1.2.3:10280", "http://10.1.2.3/healthz", "https://h:1/x", "http://:1/x"):
        with pytest.raises(ValueError, match="--liveness-endpoint must be"):
            url(bad)
