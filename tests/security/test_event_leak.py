"""Issue 41, item 1 (and the engine's half of item 2): the event streams leaked prompts to
anyone who connected.

What an attacker did: against a loopback ``mmis serve`` with ``--kv-events-endpoint``, a client
with no key connected to the replay socket, asked for everything from sequence 0 and decoded
another user's prompt ("my password is ... my ssn is ...") from ``BlockStored.token_ids``;
any host that reached ports 5557-5560 could do the same.

Here one real ``mmis serve`` (the tiny LLaVA) publishes both event streams on loopback with
the events token (``MMIS_ENGINE_EVENTS_TOKEN``, passed by ``mmis serve`` to its engine):

- a subscriber presenting the token decodes both streams, live and replayed, while a chat
  with a secret in its prompt and an image is served: the chat's blocks are announced, no
  ``BlockStored`` carries token ids, and no run of the secret's token ids is anywhere in the
  payloads, nor the image's uuid;
- a subscriber with a wrong password and one without credentials (ZMQ's NULL mechanism)
  receive nothing live while the right one does, and their replay requests are never answered;
- ``mmis engine`` asked to bind an event socket on a non-loopback address without a token
  refuses to start, with one line naming the flag.

The secret chat's image carries a client uuid (``passport-scan-7781``): since P0 binds uuids
per tenant (item 5) the streams name items by their content hash only, so every announced
``mm_hash`` (item events and blocks' extra keys) is 64 hex characters and the uuid is in no
payload.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import MMIS, OFFLINE, Proc, image_url
from tools import free_port

from mmis.engine.event_auth import secure_client
from mmis.engine.event_publisher import END_SEQ
from mmis.protocol.kv_events import (
    KV_DECODER,
    MM_DECODER,
    BlockStored,
    MMItemEvicted,
    MMItemStored,
)
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "a5" * 32  # the shape of the operator's Secret: 64 hex characters
SECRET = "my password is hunter2 my ssn is 078-05-1120"
UUID = "passport-scan-7781"  # the client's own name for its image: never on a stream
CONTENT_HASH = re.compile(r"[0-9a-f]{64}")
STREAMS = ("kv", "mm")


class Running:
    def __init__(self, serve: Proc, pubs: dict[str, str], replays: dict[str, str]) -> None:
        self.serve = serve
        self.pubs = pubs  # stream -> its PUB endpoint
        self.replays = replays  # stream -> its replay ROUTER endpoint


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    pubs = {s: f"tcp://127.0.0.1:{free_port()}" for s in STREAMS}
    replays = {s: f"tcp://127.0.0.1:{free_port()}" for s in STREAMS}
    args = ["serve", "--port", "0", "--model", str(tiny_model_dir())]
    args += ["--served-model-name", "tiny"]
    for stream in STREAMS:
        args += [f"--{stream}-events-endpoint", pubs[stream]]
        args += [f"--{stream}-events-replay-endpoint", replays[stream]]
    env = {"MMIS_ENGINE_EVENTS_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    serve = Proc(
        "event-leak-serve", args, tmp_path_factory.mktemp("event-leak"), env, announces=True
    )
    try:
        serve.wait_http("/ready", 300)
        yield Running(serve, pubs, replays)
    finally:
        serve.stop()


def _socket(kind: int, endpoint: str, token: str | None) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if token is not None:
        secure_client(sock, token)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _replay(endpoint: str, token: str | None, wait_s: float = 10.0) -> list[bytes] | None:
    """Every payload the replay socket holds from 0, or None if it never answers (a stranger's
    DEALER may not even get to send: once its refused handshake has dropped the connection it
    has no peer, and a send would block for ever; bounded by ``wait_s`` too)."""
    dealer = _socket(zmq.DEALER, endpoint, token)
    dealer.setsockopt(zmq.SNDTIMEO, int(wait_s * 1000))
    try:
        try:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        except zmq.Again:
            return None
        payloads = []
        while dealer.poll(int(wait_s * 1000)):
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return payloads
            payloads.append(frames[3])
        return None
    finally:
        dealer.close()


def _drain(sock: zmq.Socket[bytes]) -> list[bytes]:
    payloads = []
    while sock.poll(0):
        payloads.append(sock.recv_multipart()[2])
    return payloads


def _chat(
    running: Running, text: str, color: tuple[int, int, int], uuid: str | None = None
) -> None:
    image: dict[str, Any] = {"url": image_url(color)}
    if uuid is not None:
        image["uuid"] = uuid
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": image},
                    {"type": "text", "text": text},
                ],
            }
        ],
    }
    answer = httpx.post(running.serve.root_url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text


def _secret_runs() -> list[bytes]:
    """The secret's token ids, four at a time, as msgpack writes them inside an int array."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    ids = tokenizer(SECRET, add_special_tokens=False).input_ids[1:-1]  # ends may merge
    assert len(ids) >= 8
    enc = msgspec.msgpack.encode
    return [b"".join(enc(i) for i in ids[k : k + 4]) for k in range(len(ids) - 3)]


def _leaks(payload: bytes, runs: list[bytes]) -> bool:
    return any(run in payload for run in runs)


def _ints(value: Any) -> Iterator[list[int]]:
    """Every list of ints anywhere in a decoded msgpack value."""
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, int) for v in value):
            yield list(value)
        for v in value:
            yield from _ints(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _ints(v)


def test_events_carry_no_prompt(running: Running) -> None:
    runs = _secret_runs()
    leaky = BlockStored([b"\0" * 32], None, [7, *range(500, 540)], 16, None, "GPU", None)
    assert not _leaks(msgspec.msgpack.encode(leaky), runs)  # the detector, on a control ...
    tokenizer_ids = msgspec.msgpack.decode(b"\x94" + runs[0])
    leaky.token_ids = [7, *tokenizer_ids, 9]
    assert _leaks(msgspec.msgpack.encode(leaky), runs)  # ... and on a leak

    subs = {s: _socket(zmq.SUB, running.pubs[s], TOKEN) for s in STREAMS}
    try:
        _chat(running, "Warm up.", (1, 2, 3))  # the subscriptions are up by its end
        time.sleep(0.5)
        for sub in subs.values():
            _drain(sub)
        text = f"{SECRET}. Again: {SECRET}. What is in the picture?"
        _chat(running, text, (200, 30, 90), uuid=UUID)
        time.sleep(1.0)  # the last step's batches reach the subscribers
        live = {s: _drain(subs[s]) for s in STREAMS}
    finally:
        for sub in subs.values():
            sub.close()
    replayed = {s: _replay(running.replays[s], TOKEN) for s in STREAMS}
    assert live["kv"] and live["mm"], "the token's holder decodes both live streams"

    kv_payloads = live["kv"] + (replayed["kv"] or [])
    stored = [
        e
        for payload in kv_payloads
        for e in KV_DECODER.decode(payload).events
        if isinstance(e, BlockStored)
    ]
    assert any(isinstance(e, BlockStored) for p in live["kv"] for e in KV_DECODER.decode(p).events)
    mm_events = [
        e for p in live["mm"] + (replayed["mm"] or []) for e in MM_DECODER.decode(p).events
    ]
    assert any(isinstance(e, MMItemStored) for e in mm_events), "the image is announced"
    # items are named by their content's hash, never by the client's uuid (item 5, P0's half)
    named = [e.mm_hash for e in mm_events if isinstance(e, MMItemStored | MMItemEvicted)]
    named += [key[0] for e in stored for keys in e.extra_keys or [] for key in keys or []]
    assert named and all(CONTENT_HASH.fullmatch(h) for h in named), named
    payloads = kv_payloads + live["mm"] + (replayed["mm"] or [])
    assert not any(_leaks(p, runs) for p in payloads), "the secret's token ids are on the stream"
    for payload in payloads:
        assert b"hunter2" not in payload and b"078-05-1120" not in payload
        assert UUID.encode() not in payload
        for ints in _ints(msgspec.msgpack.decode(payload)):
            assert len(ints) < 4, f"a list of ints on the stream: {ints[:8]}"
    assert stored and all(e.token_ids == [] for e in stored), "BlockStored carries token ids"


@pytest.mark.parametrize("token", ["wrong-" + TOKEN[6:], None], ids=["wrong-token", "null"])
def test_strangers_get_nothing(running: Running, token: str | None) -> None:
    """Live and replay, on both streams: a stranger gets nothing while the token's holder,
    subscribed at the same time, gets the batches."""
    good = {s: _socket(zmq.SUB, running.pubs[s], TOKEN) for s in STREAMS}
    bad = {s: _socket(zmq.SUB, running.pubs[s], token) for s in STREAMS}
    try:
        got: dict[str, list[bytes]] = {s: [] for s in STREAMS}
        stranger: dict[str, list[bytes]] = {s: [] for s in STREAMS}
        deadline = time.monotonic() + 60
        color = 10
        while not all(got.values()) and time.monotonic() < deadline:
            color += 1
            _chat(running, "Is this a stranger?", (color, 77, 5))
            time.sleep(0.3)
            for s in STREAMS:
                got[s] += _drain(good[s])
                stranger[s] += _drain(bad[s])
        assert all(got.values()), "the token's holder received nothing: no control"
        time.sleep(1.0)
        for s in STREAMS:
            stranger[s] += _drain(bad[s])
        assert stranger == {"kv": [], "mm": []}
    finally:
        for sock in (*good.values(), *bad.values()):
            sock.close()
    for s in STREAMS:
        assert _replay(running.replays[s], token, wait_s=3.0) is None, f"{s} replay answered"
        assert _replay(running.replays[s], TOKEN) is not None  # and still answers the picker


@pytest.mark.parametrize(
    "flags",
    [
        ["--kv-events-endpoint", "tcp://*:{port}"],
        [
            "--mm-events-endpoint",
            "tcp://127.0.0.1:{port}",
            "--mm-events-replay-endpoint",
            "tcp://0.0.0.0:{port2}",
        ],
    ],
    ids=["kv-pub-any", "mm-replay-all-addresses"],
)
def test_exposed_bind_without_token_is_refused(flags: list[str], tmp_path: Path) -> None:
    """Without a token an event socket stays on this host: ``mmis engine`` refuses a bind
    any other host could reach, before it loads the model, in one line naming the flag."""
    args = [a.format(port=free_port(), port2=free_port()) for a in flags]
    cmd = [*MMIS, "engine", "--model", str(tiny_model_dir()), "--device", "cpu"]
    cmd += ["--input-address", f"ipc://{tmp_path}/in", "--output-address", f"ipc://{tmp_path}/out"]
    env = {k: v for k, v in os.environ.items() if k != "MMIS_ENGINE_EVENTS_TOKEN"}
    done = subprocess.run(
        [*cmd, *args], env={**env, **OFFLINE}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    flag, endpoint = args[-2], args[-1]
    assert last == (
        f"mmis engine: {flag} {endpoint} is reachable from other hosts and no events token "
        "is set: set MMIS_ENGINE_EVENTS_TOKEN (docs/SECURITY.md) or bind a loopback address"
    )
    assert "loading model" not in done.stderr  # refused before anything loaded
