"""http(s) fetching against a real local HTTP server: limits, redirects, SSRF on every hop."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from mmis.frontend.client.media.fetch import MediaFetcher
from mmis.frontend.client.ssrf import SSRFGuard
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import MediaFetchError, MediaForbiddenError, MediaTooLargeError

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
LIMIT = 64 * 1024
ENDLESS = 64 * 1024 * 1024


@dataclass
class ServerState:
    paths: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    endless_ended: threading.Event = field(default_factory=threading.Event)
    endless_sent: int = 0


class Handler(http.server.BaseHTTPRequestHandler):
    state: ServerState

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        state = self.state
        state.paths.append(self.path)
        path, _, query = self.path.partition("?")
        if path == "/img.png":
            self._send(200, IMAGE, {"Content-Type": "image/png"})
        elif path == "/redirect":
            self._send(302, headers={"Location": query})
        elif path == "/r1":
            self._send(301, headers={"Location": "/r2"})
        elif path == "/r2":
            self._send(307, headers={"Location": "/img.png"})
        elif path == "/loop":
            self._send(302, headers={"Location": "/loop"})
        elif path == "/huge-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(ENDLESS))
            self.end_headers()
            state.release.wait(10)
        elif path == "/endless":
            self._endless(state)
        elif path == "/hang":
            state.release.wait(10)
        elif path == "/trickle":
            self.send_response(200)
            self.end_headers()
            while not state.release.wait(0.05):  # the server's pace, not test synchronisation
                self.wfile.write(b"x")
                self.wfile.flush()
        else:
            self._send(404, b"no")

    def _endless(self, state: ServerState) -> None:
        self.send_response(200)  # no Content-Length: the body ends when the server closes
        self.end_headers()
        chunk = b"\0" * 65536
        try:
            while state.endless_sent < ENDLESS:
                self.wfile.write(chunk)
                state.endless_sent += len(chunk)
        except OSError:
            pass
        finally:
            state.endless_ended.set()


@pytest.fixture
def server() -> Iterator[tuple[str, ServerState]]:
    state = ServerState()
    handler = type("BoundHandler", (Handler,), {"state": state})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()


def fetcher(**settings: object) -> MediaFetcher:
    base: dict[str, object] = {"allow_private_media_urls": True, "media_max_bytes": LIMIT}
    base.update(settings)
    return MediaFetcher(FrontendConfig(**base))  # type: ignore[arg-type]


async def test_fetches_an_image(server: tuple[str, ServerState]) -> None:
    base, _ = server
    f = fetcher()
    got = await f.fetch(f"{base}/img.png")
    await f.aclose()
    assert got.data == IMAGE
    assert got.content_type == "image/png"


async def test_follows_redirects_by_hand(server: tuple[str, ServerState]) -> None:
    base, state = server
    got = await fetcher().fetch(f"{base}/r1")
    assert got.data == IMAGE
    assert got.url == f"{base}/img.png"
    assert state.paths == ["/r1", "/r2", "/img.png"]


async def test_redirect_count_is_bounded(server: tuple[str, ServerState]) -> None:
    base, state = server
    with pytest.raises(MediaFetchError, match="more than 3 times"):
        await fetcher(media_max_redirects=3).fetch(f"{base}/loop")
    assert len(state.paths) == 4


async def test_non_200_is_a_fetch_error(server: tuple[str, ServerState]) -> None:
    base, _ = server
    with pytest.raises(MediaFetchError, match="HTTP 404") as info:
        await fetcher().fetch(f"{base}/missing.png", param="messages[0].content[0]")
    assert info.value.status == 400
    assert info.value.param == "messages[0].content[0]"


async def test_declared_oversize_is_refused_before_the_body(
    server: tuple[str, ServerState],
) -> None:
    base, _ = server
    with pytest.raises(MediaTooLargeError, match=f"limit of {LIMIT} bytes"):
        await fetcher().fetch(f"{base}/huge-declared")


async def test_endless_body_stops_past_the_limit(server: tuple[str, ServerState]) -> None:
    base, state = server
    with pytest.raises(MediaTooLargeError, match=f"limit of {LIMIT} bytes"):
        await fetcher().fetch(f"{base}/endless")
    # the client hung up: the server's writes failed long before its 64 MiB were out
    assert state.endless_ended.wait(10)
    assert state.endless_sent < ENDLESS


async def test_redirect_to_another_scheme_is_refused(server: tuple[str, ServerState]) -> None:
    base, _ = server
    with pytest.raises(MediaForbiddenError, match="scheme 'file'"):
        await fetcher().fetch(f"{base}/redirect?file:///etc/passwd")


async def test_private_address_is_refused_and_never_contacted(
    server: tuple[str, ServerState],
) -> None:
    base, state = server
    with pytest.raises(MediaForbiddenError, match="loopback") as info:
        await fetcher(allow_private_media_urls=False).fetch(f"{base}/img.png")
    assert info.value.status == 403
    assert state.paths == []


@pytest.mark.parametrize(
    "target",
    ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png", "http://[::1]:9/"],
)
async def test_redirect_to_a_private_address_is_refused(
    server: tuple[str, ServerState], target: str
) -> None:
    base, state = server
    # the guard is on; only the test server's own address is exempt, so hop 1 is reachable
    strict = fetcher(allow_private_media_urls=False, allowed_media_networks=("127.0.0.1/32",))
    with pytest.raises(MediaForbiddenError, match="refusing to fetch"):
        await strict.fetch(f"{base}/redirect?{target}")
    assert state.paths == [f"/redirect?{target}"]


async def test_same_redirect_is_followed_with_the_allow_option(
    server: tuple[str, ServerState],
) -> None:
    base, _ = server
    got = await fetcher().fetch(f"{base}/redirect?{base}/img.png")
    assert got.data == IMAGE


async def test_read_timeout(server: tuple[str, ServerState]) -> None:
    base, _ = server
    with pytest.raises(MediaFetchError, match="timed out"):
        await fetcher(media_read_timeout_s=0.3).fetch(f"{base}/hang")


async def test_total_deadline_stops_a_trickling_server(server: tuple[str, ServerState]) -> None:
    base, _ = server
    slow = fetcher(media_read_timeout_s=5.0, media_fetch_timeout_s=0.5)
    with pytest.raises(MediaFetchError, match="media_fetch_timeout_s"):
        await slow.fetch(f"{base}/trickle")


async def test_unreachable_first_address_falls_back_to_the_next(
    server: tuple[str, ServerState],
) -> None:
    base, _ = server
    port = int(base.rsplit(":", 1)[1])

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.2", "127.0.0.1"]  # the server listens on 127.0.0.1 only

    config = FrontendConfig(allow_private_media_urls=True, media_max_bytes=LIMIT)
    f = MediaFetcher(config, guard=SSRFGuard(allow_private=True, resolver=resolver))
    got = await f.fetch(f"http://images.test:{port}/img.png")
    assert got.data == IMAGE


async def test_connects_to_the_vetted_address_with_host_and_sni_of_the_name() -> None:
    """DNS rebinding: the name is resolved once; the connection uses that vetted address."""
    answers = [["93.184.216.34"], ["127.0.0.1"]]  # a rebinding resolver
    calls: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[min(len(calls) - 1, 1)]

    seen: list[httpx.Request] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(IMAGE))

    client = httpx.AsyncClient(transport=httpx.MockTransport(respond))
    f = MediaFetcher(FrontendConfig(), guard=SSRFGuard(resolver=resolver), client=client)
    got = await f.fetch("https://media.example/cat.png?x=1")
    await client.aclose()
    assert got.data == IMAGE
    assert calls == ["media.example"]
    (request,) = seen
    assert request.url.host == "93.184.216.34"
    assert request.url.path == "/cat.png" and request.url.query == b"x=1"
    assert request.headers["host"] == "media.example"
    assert request.extensions["sni_hostname"] == "media.example"
