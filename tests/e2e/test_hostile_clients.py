"""``mmis serve`` against hostile and careless clients: the HTTP gate, as a real process.

One ``mmis serve`` on the tiny model, with an API key, an operations port and two served
names, and real HTTP clients (httpx, the openai SDK):

- a 50 MB body (with ``Content-Length`` and chunked) is a 413 while ``/health`` keeps
  answering: its latency during the uploads is compared with its idle latency in the same
  run (a ratio, with a floor for this shared machine's scheduling noise), and the serve
  process's memory after 20 such bodies is within 100 MB of before;
- a prompt far longer than the context is refused from its length (400) without being
  tokenized whole; 100k-deep JSON is a 400 on every POST endpoint; a non-JSON content type
  is a 415;
- with ``--api-key`` nothing but ``/health`` and ``/ready`` answers without the key on the
  serving port (docs, ``/v1/models``, unknown paths included), the scheme in any case;
  ``/metrics`` and ``/stats/cache`` answer on the operations port without a key, and only
  there;
- a request naming a model the server does not serve is a 404 ``model_not_found``; every
  alias works and is listed; ``/version`` names the package version;
- ``POST /internal/block_keys`` (operations port, with the internal token of
  ``MMIS_FRONTEND_INTERNAL_TOKEN``) names a chat's prompt blocks exactly as the
  engine then announces them on ``--kv-events-endpoint``, and its image as the engine's
  ``--mm-events-endpoint`` announces it stored (docs/ROUTING.md).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import openai
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import Proc, ServeFactory, chat_body
from tools import free_port

from mmis.protocol.kv_events import KV_DECODER, MM_DECODER, BlockStored, MMItemStored
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
TOKEN = "5e" * 32  # the internal token (tests/security/test_internal_routes.py covers it)
INTERNAL = {"Authorization": f"Bearer {TOKEN}"}
MiB = 1 << 20
REPLAY: dict[str, str] = {}  # an events PUB endpoint -> its replay endpoint (the fixture's)
POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


class Running:
    def __init__(self, serve: Proc, ops_port: int, events: str, mm_events: str) -> None:
        self.serve = serve
        self.root = serve.root_url
        self.ops = f"http://127.0.0.1:{ops_port}"
        self.events = events  # the engine's KV-events PUB endpoint
        self.mm_events = mm_events  # and its multimodal one

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.serve.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def running(start_serve: ServeFactory) -> Iterator[Running]:
    ops_port = free_port()
    events = f"tcp://127.0.0.1:{free_port()}"
    mm_events = f"tcp://127.0.0.1:{free_port()}"
    extra = ["--model", str(tiny_model_dir()), "--served-model-name", "tiny,tiny-alias"]
    extra += ["--api-key", KEY, "--ops-port", str(ops_port), "--kv-events-endpoint", events]
    extra += ["--mm-events-endpoint", mm_events]
    for pub in (events, mm_events):
        REPLAY[pub] = f"tcp://127.0.0.1:{free_port()}"
    extra += ["--kv-events-replay-endpoint", REPLAY[events]]
    extra += ["--mm-events-replay-endpoint", REPLAY[mm_events]]
    env = {"MMIS_FRONTEND_INTERNAL_TOKEN": TOKEN}
    with start_serve("hostile-serve", *extra, env=env) as serve:
        yield Running(serve, ops_port, events, mm_events)


class HealthSampler:
    """``GET /health`` every 10 ms on its own connection; the latencies it saw."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                if http.get(self.root + "/health").status_code != 200:
                    self.failures += 1
                self.latencies.append(time.perf_counter() - started)
                self._stop.wait(0.01)

    def __enter__(self) -> HealthSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _chunks(body: bytes, size: int = MiB) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def test_oversized_bodies_are_413_while_health_answers(running: Running) -> None:
    body = json.dumps({"model": "tiny", "prompt": "a" * (50 * MiB)}).encode()
    with HealthSampler(running.root) as idle:
        while len(idle.latencies) < 30:
            time.sleep(0.05)  # sampling the idle latency for a while; not a synchronisation
    idle_p50 = statistics.median(idle.latencies)
    before = running.rss_mb()
    with HealthSampler(running.root) as busy, httpx.Client(timeout=60) as http:
        for i in range(20):
            content = body if i % 2 == 0 else _chunks(body)  # Content-Length, then chunked
            answer = http.post(running.root + "/v1/completions", content=content, headers=JSON)
            assert answer.status_code == 413, answer.text[:300]
            error = answer.json()["error"]
            assert error["code"] == "request_too_large"
            assert "--max-request-body-mb" in error["message"]
    after = running.rss_mb()
    assert busy.failures == 0
    assert len(busy.latencies) >= 10
    busy_p50 = statistics.median(busy.latencies)
    # the old server parsed and tokenized such a body on the event loop: /health stalled for
    # over a minute. A ratio to the idle latency, floored at 50 ms of scheduling noise
    assert busy_p50 <= max(10 * idle_p50, 0.05), (idle_p50, busy_p50)
    assert max(busy.latencies) <= max(50 * idle_p50, 1.0), (idle_p50, max(busy.latencies))
    assert after - before <= 100, (before, after)


def test_prompt_longer_than_the_context_is_refused_from_its_length(running: Running) -> None:
    prompt = "ab " * (8 * MiB // 3)
    answer = httpx.post(
        running.root + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
        headers=AUTH,
        timeout=60,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    assert "characters" in error["message"]  # refused from its length, before tokenizing


def test_deep_json_is_400_on_every_post_endpoint(running: Running) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with httpx.Client(timeout=60) as http:
        for path in POSTS:
            answer = http.post(running.root + path, content=deep, headers=JSON)
            assert answer.status_code == 400, (path, answer.text[:300])
            assert answer.json()["error"]["type"] == "invalid_request_error"
        nested = {"model": "tiny", "prompt": "hi", "user": json.loads("[" * 500 + "]" * 500)}
        answer = http.post(running.root + "/v1/completions", json=nested, headers=AUTH)
        assert answer.status_code == 400, answer.text[:300]


def test_non_json_content_types_are_415(running: Running) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1})
    with httpx.Client(timeout=60) as http:
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            answer = http.post(
                running.root + "/v1/completions",
                content=body,
                headers={**AUTH, "Content-Type": content_type},
            )
            assert answer.status_code == 415, answer.text
            assert answer.json()["error"]["code"] == "unsupported_media_type"
        charset = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
        assert http.post(running.root + "/v1/completions", content=body, headers=charset).is_success


def test_only_probes_answer_without_the_key(running: Running) -> None:
    closed = ["/v1/models", "/version", "/openapi.json", "/docs", "/redoc", "/metrics"]
    closed += ["/stats/cache", "/no/such/path"]
    with httpx.Client(timeout=30) as http:
        for path in closed:
            answer = http.get(running.root + path)
            assert answer.status_code == 401, path
            assert answer.json()["error"]["code"] == "invalid_api_key"
        for path in POSTS:
            assert http.post(running.root + path, json={}).status_code == 401, path
        for path in ("/health", "/ready"):
            assert http.get(running.root + path).status_code == 200, path
        for scheme in ("Bearer", "bearer", "BEARER"):
            keyed = http.get(
                running.root + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}
            )
            assert keyed.status_code == 200, scheme
        wrong = http.get(running.root + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        basic = http.get(running.root + "/v1/models", headers={"Authorization": f"Basic {KEY}"})
        assert basic.status_code == 401
        # the operations routes live on the operations port, without a key, and only there
        assert "mmis_frontend_" in http.get(running.ops + "/metrics").text
        assert "drift_rate" in http.get(running.ops + "/stats/cache").json()
        assert http.get(running.root + "/metrics", headers=AUTH).status_code == 404
        assert http.get(running.ops + "/v1/models").status_code == 404
        assert http.get(running.ops + "/health").status_code == 200


def test_model_names_aliases_and_version(running: Running) -> None:
    client = openai.OpenAI(base_url=running.root + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
    assert missing.value.code == "model_not_found"
    body = missing.value.body
    assert isinstance(body, dict) and body.get("param") == "model"
    request = chat_body((10, 200, 10), max_tokens=2) | {"model": "tiny-alias"}
    answer = client.chat.completions.create(**request)
    assert answer.model == "tiny"  # answers (and metrics) name the first alias
    answer = httpx.get(running.root + "/version", headers=AUTH, timeout=30)
    assert answer.json() == {"version": metadata.version("mmis")}


def replay(endpoint: str) -> str:
    """The replay endpoint the fixture gives beside a PUB endpoint (one per stream)."""
    return REPLAY[endpoint]


def _replayed(dealer: zmq.Socket[bytes], start: int) -> list[bytes]:
    """Every batch payload from sequence ``start`` on (the engine buffers them)."""
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    payloads = []
    while True:
        assert dealer.poll(10_000), "no replay answer"
        frames = dealer.recv_multipart()
        if frames[2] == b"\xff" * 8:
            return payloads
        payloads.append(frames[3])


def test_block_keys_are_the_blocks_the_engine_announces(running: Running) -> None:
    """What a router asks P0 before it routes equals what P1 announces once it served the
    request: the same hashes in the same order, the image's blocks included."""
    body = chat_body((11, 122, 233), max_tokens=1)  # only the prompt's KV is computed
    with httpx.Client(timeout=60) as http:
        assert (
            http.post(running.root + "/internal/block_keys", json=body, headers=JSON).status_code
            == 404
        )
        answer = http.post(running.ops + "/internal/block_keys", json=body, headers=INTERNAL)
        assert answer.status_code == 200, answer.text
        keys = answer.json()
        assert keys["prompt_tokens"] >= 2 * keys["block_size"] and len(keys["mm_hashes"]) == 1
        assert len(keys["block_keys"]) == keys["prompt_tokens"] // keys["block_size"]
        context = zmq.Context.instance()
        kv, mm = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        try:
            kv.connect(replay(running.events))
            mm.connect(replay(running.mm_events))
            kv_seen, mm_seen = _replayed(kv, 0), _replayed(mm, 0)  # what /ready's request left
            done = http.post(running.root + "/v1/chat/completions", json=body, headers=JSON)
            assert done.status_code == 200, done.text
            announced = [
                h.hex()
                for payload in _replayed(kv, len(kv_seen))
                for e in KV_DECODER.decode(payload).events
                if isinstance(e, BlockStored)
                for h in e.block_hashes
            ]
            items = [
                e for payload in _replayed(mm, len(mm_seen))
                for e in MM_DECODER.decode(payload).events
            ]  # fmt: skip
        finally:
            kv.close(linger=0)
            mm.close(linger=0)
        # the image: stored in P1's receiver cache under the hash P0 named
        assert [(type(e), e.mm_hash) for e in items] == [(MMItemStored, keys["mm_hashes"][0])]
        assert announced == keys["block_keys"]
        # asking again changed nothing: the image is now a shadow hit, and the keys agree
        again = http.post(running.ops + "/internal/block_keys", json=body, headers=INTERNAL)
        assert again.json() == keys
