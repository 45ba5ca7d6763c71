"""``--api-servers``: the setting, each child's settings, the group's files, the private socket.

Unit tests of the pieces; the processes themselves are exercised in
``tests/e2e/test_api_servers.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from mmis.config import ConfigError
from mmis.entrypoints import frontend
from mmis.entrypoints.api_servers import child_settings
from mmis.frontend.api.api_server_group import ApiServerGroup
from mmis.frontend.api.http_gate import HttpGate
from mmis.frontend.config import MAX_API_SERVERS, FrontendConfig
from mmis.telemetry.catalog import API_SERVER_INDICES


def _parse(*argv: str) -> FrontendConfig:
    parser = argparse.ArgumentParser()
    frontend.add_arguments(parser)
    return frontend.settings_from(parser.parse_args(["--model", "m", *argv]))


def test_one_process_by_default_and_the_bounds() -> None:
    assert _parse().api_servers == 1
    assert _parse("--api-servers", "64").api_servers == 64
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="--api-servers must be 1 to 64"):
            _parse("--api-servers", bad)
    assert {str(i) for i in range(MAX_API_SERVERS)} == API_SERVER_INDICES  # the label's set


def test_the_environment_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMIS_FRONTEND_API_SERVERS", "3")
    assert _parse().api_servers == 3
    assert _parse("--api-servers", "2").api_servers == 2  # the flag wins


def test_each_child_has_its_client_index_and_its_share_of_shm() -> None:
    settings = FrontendConfig(model="m", api_servers=4, client_index=2, shm_gb=2.0)
    children = [child_settings(settings, i) for i in range(4)]
    assert [c.client_index for c in children] == [2, 3, 4, 5]
    assert sum(c.shm_gb for c in children) == pytest.approx(settings.shm_gb)  # the total
    assert {c.model for c in children} == {"m"}


def test_the_group_says_why_a_start_should_stop_waiting(tmp_path: Path) -> None:
    group = ApiServerGroup(0, 2, str(tmp_path), parent_pid=os.getppid())
    assert group.engine_failed() is None
    (tmp_path / "engine-failed").write_text("SafetensorError: bad header\n")
    assert group.engine_failed() == "SafetensorError: bad header"
    (tmp_path / "engine-failed").unlink()
    (tmp_path / "stopping").write_text("stopping")
    assert "stopped before this process was ready" in (group.engine_failed() or "")
    orphan = ApiServerGroup(0, 2, str(tmp_path / "x"), parent_pid=os.getppid() + 1)
    assert "exited before this process was ready" in (orphan.engine_failed() or "")


def test_status_and_restart_files_round_trip(tmp_path: Path) -> None:
    group = ApiServerGroup(1, 2, str(tmp_path))
    assert group.status(1) == "" and group.restarts() == {}
    group.set_status(1, "ready")
    assert group.status(1) == "ready"
    Path(group.restarts_path).write_text('{"0": 2, "1": 0}')
    assert group.restarts() == {0: 2, 1: 0}
    Path(group.restarts_path).write_text("{half")
    assert group.restarts() == {}


# -- the private socket in the HTTP gate -------------------------------------------------------
PRIVATE = "/run/p0/api-server-0.sock"


def _call(gate: HttpGate, path: str, server: Any) -> int:
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {"type": "http", "method": "GET", "path": path, "headers": [], "server": server}
    asyncio.run(gate(scope, receive, send))
    return statuses[0]


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("ops_port", [None, 9100])
def test_the_private_socket_answers_as_the_operations_port(ops_port: int | None) -> None:
    gate = HttpGate(
        _ok, api_keys=["k"], max_body_bytes=1024, ops_port=ops_port, private_socket=PRIVATE
    )
    private = (PRIVATE, None)
    assert _call(gate, "/metrics", private) == 200  # no key: a sibling's scrape
    assert _call(gate, "/stats/cache", private) == 200
    assert _call(gate, "/health", private) == 200
    assert _call(gate, "/v1/models", private) == 404  # nothing else
    assert _call(gate, "/metrics", ("/elsewhere.sock", None)) != 200  # another unix socket
    assert _call(gate, "/v1/models", ("127.0.0.1", 8000)) == 401  # the API keeps its key


def test_without_a_private_socket_a_unix_connection_is_the_serving_port() -> None:
    gate = HttpGate(_ok, api_keys=["k"], max_body_bytes=1024, ops_port=9100)
    assert _call(gate, "/metrics", (PRIVATE, None)) != 200


def test_is_private_matches_only_its_own_socket(tmp_path: Path) -> None:
    group = ApiServerGroup(1, 2, str(tmp_path))
    assert group.is_private({"server": (group.socket_path(1), None)})
    assert not group.is_private({"server": (group.socket_path(0), None)})
    assert not group.is_private({"server": ("127.0.0.1", 8000)})
    assert not group.is_private({})
