"""S2, S3, S4, S5 and S10 end to end: real processes, the ``openai`` SDK and raw HTTP.

Three stacks, each shared by the tests of this module and stopped in teardown:

- *clean*: ``mmis engine`` + ``mmis frontend`` in SHM mode with strict media limits. It is
  drift-free, so it gives the expected outputs of S2/S5 (greedy decoding) and takes S10's
  storm, after which P0's leak gauges and P1's queue gauges on ``/metrics`` must be zero.
- *faulty*: ``mmis engine --fault-evict-rate 1`` (every shadow hit reaches P1 after P1
  evicted the item) + ``mmis frontend``: S2, S3 and S5.
- *scripted*: the scripted P1 of ``tests/frontend/fake_engine.py`` run as its own process
  (``scripted_engine_main.py``; its knobs are set over stdin, each acknowledged) + a real
  ``mmis frontend``: S4, where the retry must miss too.
"""

from __future__ import annotations

import base64
import io
import json
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from procs import Frontend, Launcher, chat_body, image_url, series

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

Color = tuple[int, int, int]
A, B, C, D, E = (200, 30, 30), (30, 200, 30), (30, 30, 200), (150, 150, 20), (20, 150, 150)
CHAT = "/v1/chat/completions"
LEAK_GAUGES = ("engine_requests_in_flight", "pending_invalidations", "shm_used_bytes")


def image_part(color: Color, uuid: str | None = None, *, with_data: bool = True) -> dict:
    inner: dict[str, Any] = {"url": image_url(color)} if with_data else {}
    if uuid is not None:
        inner["uuid"] = uuid
    return {"type": "image_url", "image_url": inner}


def messages(*parts: dict, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def sdk(frontend: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="x", timeout=120, max_retries=0)


def chat(frontend: Frontend, *parts: dict, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return sdk(frontend).chat.completions.create(model="tiny", messages=messages(*parts), **kw)


# ---------------------------------------------------------------------------- stacks
@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, media_root: Path) -> Iterator[Frontend]:
    tmp = tmp_path_factory.mktemp("clean")
    shm = tmp / "shm"
    shm.mkdir()
    launch = Launcher(tmp)
    try:
        engine = launch.engine("clean-engine", "--mm-cache-type", "shm", "--shm-dir", str(shm))
        yield launch.frontend(
            "clean-frontend",
            engine,
            *("--mm-cache-type", "shm", "--shm-dir", str(shm), "--shm-gb", "0.01"),
            *("--max-model-len", "256", "--max-images-per-prompt", "4"),
            *("--allowed-local-media-path", str(media_root), "--stats-interval-s", "0.2"),
        )
    finally:
        launch.close()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    launch = Launcher(tmp_path_factory.mktemp("faulty"))
    try:
        engine = launch.engine("faulty-engine", "--fault-evict-rate", "1")
        yield launch.frontend("faulty-frontend", engine)
    finally:
        launch.close()


class ScriptedEngine:
    """``scripted_engine_main.py`` in its own process; knobs set over stdin, acknowledged."""

    MAIN = Path(__file__).with_name("scripted_engine_main.py")

    def __init__(self, directory: Path, epoch: str) -> None:
        self.input_address = f"ipc://{directory}/p1-in"
        self.output_address = f"ipc://{directory}/p1-out"
        self._log = open(directory / f"scripted-{epoch}.log", "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            [sys.executable, str(self.MAIN), str(directory), "--epoch", epoch],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        if self._line() != "ready":
            self.stop()
            raise RuntimeError(f"the scripted engine did not start (see {self._log.name})")

    def _line(self) -> str:
        assert self.popen.stdout is not None
        return self.popen.stdout.readline().decode().strip()

    def command(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()
        assert self._line() == "ok", line

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()


class ScriptedStack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.engine = ScriptedEngine(tmp, "epoch-1")
        self.launch = Launcher(tmp)
        self.frontend = self.launch.frontend("scripted-frontend", self.engine)  # type: ignore[arg-type]

    def restart_engine(self, epoch: str) -> None:
        self.engine.stop(signal.SIGKILL)
        self.engine = ScriptedEngine(self.tmp, epoch)

    def close(self) -> None:
        self.launch.close()
        self.engine.stop()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedStack]:
    stack = ScriptedStack(tmp_path_factory.mktemp("scripted"))
    try:
        yield stack
    finally:
        stack.close()


def retries(frontend: Frontend, route: str = CHAT, **labels: str) -> float:
    return series(frontend, "mmis_mm_retries_total", endpoint=route, **labels)


# ---------------------------------------------------------------------------- S2
def test_s2_two_drifted_items_one_error_one_retry(clean: Frontend, faulty: Frontend) -> None:
    expected = chat(clean, image_part(A), image_part(B), image_part(C))
    chat(faulty, image_part(A))  # A and B now cached in the shadow and in P1
    chat(faulty, image_part(B))
    drift, healed = series(faulty, "mmis_drift_misses_total"), retries(faulty)
    hits = series(faulty, "mmis_shadow_hits_total")
    got = chat(faulty, image_part(A), image_part(B), image_part(C))
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert series(faulty, "mmis_shadow_hits_total") == hits + 2  # A, B sent without data
    assert series(faulty, "mmis_drift_misses_total") == drift + 2  # one error naming both
    assert retries(faulty) == healed + 1
    assert retries(faulty, outcome="success") >= 1


# ---------------------------------------------------------------------------- S3
def test_s3_hash_only_client_gets_a_structured_422(faulty: Frontend) -> None:
    first = chat(faulty, image_part(D, uuid="photo-d"))
    unrelated = chat(faulty, image_part(E))
    barrier = threading.Barrier(2)

    def hash_only() -> httpx.Response:
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0}
        body["messages"] = messages(image_part(D, uuid="photo-d", with_data=False))
        barrier.wait(30)
        return httpx.post(faulty.base_url + "/chat/completions", json=body, timeout=120)

    def other() -> Any:
        barrier.wait(30)
        return chat(faulty, {"type": "text", "text": "Hello there"}, max_tokens=8)

    with ThreadPoolExecutor(2) as pool:
        refused_future, other_future = pool.submit(hash_only), pool.submit(other)
        refused, concurrent = refused_future.result(), other_future.result()
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "multimodal_cache_miss"
    assert error["retryable"] is True
    assert error["missing_uuids"] == ["photo-d"]
    assert "photo-d" in error["message"]
    assert concurrent.choices[0].finish_reason in ("length", "stop")
    resent = chat(faulty, image_part(D, uuid="photo-d"))
    assert resent.choices[0].message.content == first.choices[0].message.content
    assert chat(faulty, image_part(E)).choices[0].message.content == (
        unrelated.choices[0].message.content
    )


# ---------------------------------------------------------------------------- S5
def test_s5_n3_drifted_request_retries_once_with_three_choices(
    clean: Frontend, faulty: Frontend
) -> None:
    part = image_part((5, 90, 210))
    expected = chat(clean, part, n=3)
    chat(faulty, part)  # cached in the shadow and in P1: the next one is a shadow hit
    before = retries(faulty)
    got = chat(faulty, part, n=3)
    assert len(got.choices) == 3
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert [c.message.content for c in got.choices] == [c.message.content for c in expected.choices]
    assert retries(faulty) == before + 1  # one terminal error handled once, not three
    assert faulty.metric("engine_requests_in_flight") == 0


# ---------------------------------------------------------------------------- S10
def _png(size: tuple[int, int] = (16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _huge_header_png(width: int, height: int) -> bytes:
    """A small PNG whose IHDR claims ``width x height`` (CRC fixed so the header is valid)."""
    data = bytearray(_png())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _storm(media_root: Path) -> dict[str, tuple[list[dict], int, str | None]]:
    """name -> (messages, HTTP status, error code or None when only the status is fixed)."""
    outside = media_root.parent / "outside.png"
    outside.write_bytes(_png())
    (media_root / "inside.png").write_bytes(_png())
    return {
        "broken base64": (messages(_url_part("data:image/png;base64,@@nope@@")), 400, None),
        "not an image": (messages(_url_part(_data_url(b"no pixels", "text/plain"))), 400, None),
        "truncated png": (messages(_url_part(_data_url(_png((64, 64))[:60]))), 400, None),
        "20000x20000": (
            messages(_url_part(_data_url(_huge_header_png(20000, 20000)))),
            400,
            "media_too_large",
        ),
        "too many images": (
            messages(*[image_part((i, 2 * i, 3 * i)) for i in range(5)]),
            400,
            "too_many_images",
        ),
        # a literal private address: refused by the SSRF check before any connection
        "private url": (messages(_url_part("http://10.0.0.1/x.png")), 403, "media_forbidden"),
        "file outside root": (messages(_url_part(outside.as_uri())), 403, "media_forbidden"),
        "over-long prompt": (
            messages(image_part(A), text="the quick brown fox " * 200),
            400,
            "context_length_exceeded",
        ),
    }


def _wait_for(read: Callable[[], float], value: float, timeout: float = 30.0) -> float:
    """Poll another process's gauge until it reads ``value``; return the last reading."""
    deadline = time.monotonic() + timeout
    while (seen := read()) != value and time.monotonic() < deadline:
        time.sleep(0.2)  # polling another process's scrape; not a synchronisation
    return seen


def test_s10_bad_input_storm_then_nothing_leaked(clean: Frontend, media_root: Path) -> None:
    url = clean.base_url + "/chat/completions"
    good = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    inside = {**good, "messages": messages(_url_part((media_root / "inside.png").as_uri()))}
    with httpx.Client(timeout=120) as http:
        before = http.post(url, json=chat_body(D))
        assert before.status_code == 200, before.text
        for name, (msgs, status, code) in _storm(media_root).items():
            response = http.post(url, json={**good, "messages": msgs})
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"], (name, error)
            assert "internal" not in error["message"].lower(), (name, error)
            if code is not None:
                assert error["code"] == code, (name, error)
        assert http.post(url, json=inside).status_code == 200  # file:// under the root works
        after = http.post(url, json=chat_body(D))
        assert after.status_code == 200, after.text
        content = after.json()["choices"][0]["message"]["content"]
        assert content == before.json()["choices"][0]["message"]["content"]
    for gauge in LEAK_GAUGES:
        assert _wait_for(lambda g=gauge: clean.metric(g), 0.0) == 0.0, gauge
    for gauge in ("mmis:num_requests_running", "mmis:num_requests_waiting"):
        assert _wait_for(lambda g=gauge: series(clean, g), 0.0) == 0.0, gauge
    assert series(clean, "mmis_engine_up") == 1.0


# ---------------------------------------------------------------------------- S4
@pytest.mark.parametrize("endpoint", ["chat", "completions", "embeddings"])
def test_s4_second_miss_is_a_503(scripted: ScriptedStack, endpoint: str) -> None:
    frontend = scripted.frontend
    route = {"chat": CHAT, "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
    failed = retries(frontend, route[endpoint], outcome="failed")
    scripted.engine.command("force 2")  # the first try and the retry both miss
    client = sdk(frontend)
    with pytest.raises(openai.InternalServerError) as err:
        if endpoint == "chat":
            chat(frontend, image_part((9, 9, 9)))
        elif endpoint == "completions":
            client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        else:
            client.embeddings.create(
                model="tiny",
                input=[image_part((9, 9, 9)), {"type": "text", "text": "x"}],  # type: ignore[list-item]
            )
    assert err.value.status_code == 503
    body = err.value.body
    assert isinstance(body, dict)  # the SDK unwraps {"error": {...}}
    assert body["code"] == "multimodal_cache_miss" and body["retryable"] is True
    assert retries(frontend, route[endpoint], outcome="failed") == failed + 1
    # the budget was exactly spent: the next request is served
    assert chat(frontend, image_part((9, 9, 9))).choices[0].finish_reason == "length"


def test_s4_stream_miss_before_first_byte_is_a_503_status(scripted: ScriptedStack) -> None:
    scripted.engine.command("force 2")
    with pytest.raises(openai.InternalServerError) as err:
        list(chat(scripted.frontend, image_part((8, 8, 8)), stream=True))
    assert err.value.status_code == 503


def test_s4_stream_that_sent_bytes_ends_with_an_sse_error_event(scripted: ScriptedStack) -> None:
    scripted.engine.command("pause-after-first-token")
    body = {"model": "tiny", "stream": True, "max_tokens": 8}
    body["messages"] = messages(image_part((70, 7, 7)))
    lines: list[str] = []
    url = scripted.frontend.base_url + "/chat/completions"
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 1:  # bytes are out: P1 dies and a new one takes its place
                scripted.restart_engine("epoch-2")
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    # P1's end closed: the engine client saw it gone (before any restart) and said so
    assert error["code"] == "engine_unavailable" and error["retryable"] is True
    assert lines[-1] == "data: [DONE]"
    # the new engine serves the next request
    again = chat(scripted.frontend, image_part((70, 7, 7)))
    assert again.choices[0].finish_reason == "length"
