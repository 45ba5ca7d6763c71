"""Issue 41, item 4: ``/internal/*`` answers only the internal token, on every port.

What an attacker did: on the operations port, ``POST /internal/reset_prefix_cache`` with no
key at all returned ``{"blocks": 4}`` while ``--api-key`` was set; ``/internal/block_keys``
decoded and processed a 9 MP image for anyone, on the render thread API traffic uses, and
its 422-vs-200 told whether a uuid was cached.

The rule (docs/SECURITY.md, "The internal token"): ``/internal/block_keys`` and
``/internal/reset_prefix_cache`` answer only ``Authorization: Bearer <token>`` with the token
of ``MMIS_FRONTEND_INTERNAL_TOKEN``, on whichever port serves them (``--ops-port``, or the
serving port without it); the API key does not open them; a missing or wrong token is 401
``invalid_internal_token``; without a configured token they are 403
``internal_routes_disabled``. The operator's ``/internal/load_lora_adapter`` and
``/internal/unload_lora_adapter`` (issue 47) are gated the same way (behind the token they reach
the engine, which runs without LoRA here: a 400 saying so). ``/metrics``, ``/stats/cache``,
``/health`` and ``/ready`` stay as they were. The gate decides from the headers alone, before
any body byte is read.

Real processes: one ``mmis engine`` on the tiny model and three ``mmis frontend`` on it (P0
configurations: operations port + token, serving port + token, no token), real HTTP clients.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import Launcher, chat_body
from tools import free_port

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "sk-client"
TOKEN = "f3" * 32  # what the operator's Secret holds: 64 hex characters
INTERNAL = ("/internal/block_keys", "/internal/reset_prefix_cache")
LORA = ("/internal/load_lora_adapter", "/internal/unload_lora_adapter")  # the operator's
GATED = INTERNAL + LORA
OPEN = ("/metrics", "/stats/cache", "/health", "/ready")


class Stack:
    def __init__(self, launcher: Launcher) -> None:
        engine = launcher.engine("engine")
        self.ops_port = free_port()
        token = {"MMIS_FRONTEND_INTERNAL_TOKEN": TOKEN}
        keyed = ("--api-key", KEY)
        # operations port + internal token
        self.split = launcher.frontend(
            "p0-ops", engine, *keyed, "--ops-port", str(self.ops_port), "--client-index", "0",
            env=token, wait=False,
        )  # fmt: skip
        self.ops = f"http://127.0.0.1:{self.ops_port}"
        # no operations port: /internal/* on the serving port, with the token
        self.single = launcher.frontend(
            "p0-one", engine, *keyed, "--client-index", "1", env=token, wait=False
        )
        # no token configured at all
        self.closed = launcher.frontend(
            "p0-none", engine, *keyed, "--client-index", "2", wait=False
        )
        for frontend in (self.split, self.single, self.closed):  # loading side by side
            frontend.wait_ready()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    launcher = Launcher(tmp_path_factory.mktemp("internal-routes"))
    try:
        yield Stack(launcher)
    finally:
        launcher.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def post(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body: dict[str, Any] | None = chat_body((9, 99, 199)) if "block_keys" in url else None
    if "lora_adapter" in url:
        body = {"lora_name": "x", "lora_path": "/x"}
    return httpx.post(url, json=body, headers=headers or {}, timeout=60)


def opened(answer: httpx.Response, path: str) -> None:
    """``path``'s answer once the token opened it."""
    if path in LORA:  # the route ran and asked the engine, which serves no adapters here
        assert answer.status_code == 400, answer.text
        assert "without --enable-lora" in error(answer)["message"]
        return
    assert answer.status_code == 200, answer.text


def error(answer: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = answer.json()["error"]
    return body


@pytest.mark.parametrize("path", GATED)
def test_the_operations_port_answers_internal_routes_only_with_the_token(
    stack: Stack, path: str
) -> None:
    url = stack.ops + path
    for headers in (
        None,  # what the attacker sent
        bearer(KEY),  # the API key does not open them
        bearer("0" * 64),
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
    ):
        answer = post(url, headers)
        assert answer.status_code == 401, (headers, answer.text)
        assert error(answer)["code"] == "invalid_internal_token"
        assert answer.headers["www-authenticate"] == "Bearer"
    answer = post(url, bearer(TOKEN))
    opened(answer, path)
    if path.endswith("reset_prefix_cache"):
        assert isinstance(answer.json()["blocks"], int)
    elif path.endswith("block_keys"):
        assert len(answer.json()["mm_hashes"]) == 1


def test_the_token_is_checked_before_any_body_byte_is_read(stack: Stack) -> None:
    """A request that announces a 1 GB body and sends none is refused from its headers."""
    request = (
        "POST /internal/block_keys HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", stack.ops_port), timeout=10) as conn:
        conn.sendall(request.encode())
        answer = _read_response(conn)
    assert answer.startswith("HTTP/1.1 401"), answer
    assert "invalid_internal_token" in answer


def _read_response(conn: socket.socket) -> str:
    """One whole HTTP/1.1 response: headers, then as many body bytes as Content-Length says.

    The server may write the head and the body in separate segments; one ``recv`` can return
    the head alone. A timeout (the server waiting for the announced body) fails the test.
    """
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data.decode(errors="replace")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def test_without_an_ops_port_the_serving_port_needs_the_token(stack: Stack) -> None:
    root = stack.single.root_url
    for path in GATED:
        assert post(root + path).status_code == 401
        keyed = post(root + path, bearer(KEY))
        assert keyed.status_code == 401, keyed.text
        assert error(keyed)["code"] == "invalid_internal_token"
        opened(post(root + path, bearer(TOKEN)), path)
    # and the token opens nothing else: the API still needs the key
    models = httpx.get(root + "/v1/models", headers=bearer(TOKEN), timeout=30)
    assert models.status_code == 401 and error(models)["code"] == "invalid_api_key"
    assert httpx.get(root + "/v1/models", headers=bearer(KEY), timeout=30).status_code == 200


def test_the_serving_port_does_not_serve_them_when_an_ops_port_is_set(stack: Stack) -> None:
    root = stack.split.root_url
    for path in GATED:
        assert post(root + path, bearer(TOKEN)).status_code == 401  # the API key's gate
        assert post(root + path, bearer(KEY)).status_code == 404


def test_without_a_configured_token_internal_routes_are_disabled(stack: Stack) -> None:
    root = stack.closed.root_url
    for path in GATED:
        for headers in (None, bearer(KEY), bearer(TOKEN)):
            answer = post(root + path, headers)
            assert answer.status_code == 403, (path, headers, answer.text)
            body = error(answer)
            assert body["code"] == "internal_routes_disabled"
            assert "MMIS_FRONTEND_INTERNAL_TOKEN" in body["message"]


def test_scrapes_and_probes_stay_as_they_were(stack: Stack) -> None:
    for path in OPEN:
        assert httpx.get(stack.ops + path, timeout=30).status_code == 200, path
    for frontend in (stack.split, stack.single, stack.closed):
        for path in ("/health", "/ready"):
            assert httpx.get(frontend.root_url + path, timeout=30).status_code == 200
    # on the serving port without --ops-port, /metrics keeps needing the API key, no more
    assert httpx.get(stack.single.root_url + "/metrics", timeout=30).status_code == 401
    metrics = httpx.get(stack.single.root_url + "/metrics", headers=bearer(KEY), timeout=30)
    assert metrics.status_code == 200
