"""Issue 41, item 5: a uuid names an image for its tenant only, and never leaves P0.

What an attacker did: a client-chosen ``uuid`` was the item's cache key, a cached entry was
reused even when new data came with the uuid, and the multimodal events stream broadcast raw
uuids. Seeing ``passport-scan-7781`` on the stream, the attacker sent an id-only request
naming it and got 200: another user's image, read back; sending other data under that uuid
would have been ignored for the owner's next id-only request... or served to the owner had
the entry been evicted first (poison).

The rule (docs/SECURITY.md, "uuids per tenant"): a tenant is the API key presented (each of
``--api-key a,b`` is one); an item sent with data is keyed by its content and its uuid bound,
for the sender's tenant, to that content; a uuid-only item resolves through the sender's own
binding (none: the retryable 422 naming the uuid); new data under a bound uuid rebinds it for
that tenant only (``mmis:uuid_rebinds_total``). The uuid never leaves P0: not on P1's event
streams, not in the block keys, not in the log.

Real processes: one ``mmis serve`` on the tiny model (float32, greedy, ``ignore_eos`` so the
answers of one image are comparable) with two API keys, the openai SDK as the clients, a ZMQ
subscriber on the engine's KV and multimodal event streams (loopback) for the whole module.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import Proc, image_url, openai_client
from tools import free_port, wait_until

from mmis.frontend.client.tenancy import UuidBindings, key_tenant
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

KEY_A, KEY_B = "sk-tenant-alice", "sk-tenant-bob"
TOKEN = "7a" * 32
PASSPORT = "passport-scan-7781"
RED, BLUE, GREEN, YELLOW = (200, 30, 30), (20, 40, 210), (30, 190, 60), (230, 220, 20)
REBINDS = "mmis:uuid_rebinds_total"


class EventTap:
    """Every frame the engine publishes on its KV and multimodal event streams."""

    def __init__(self, endpoints: list[str]) -> None:
        self.frames: list[bytes] = []
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in endpoints:
            self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                self.frames.extend(self._sub.recv_multipart())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sub.close(linger=0)
        self._context.term()


class Server:
    def __init__(self, proc: Proc, ops_port: int, tap: EventTap) -> None:
        self.proc = proc
        self.ops = f"http://127.0.0.1:{ops_port}"
        self.tap = tap
        self.alice = openai_client(proc, api_key=KEY_A)
        self.bob = openai_client(proc, api_key=KEY_B)

    def rebinds(self) -> float:
        text = httpx.get(self.ops + "/metrics", timeout=30).text
        (value,) = re.findall(rf"^{re.escape(REBINDS)}\{{[^}}]*\}} (\S+)$", text, re.M)
        return float(value)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ops_port = free_port()
    kv, mm = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    args = ["serve", "--port", "0", "--model", str(tiny_model_dir())]
    args += ["--served-model-name", "tiny", "--api-key", f"{KEY_A},{KEY_B}"]
    args += ["--ops-port", str(ops_port), "--kv-events-endpoint", kv, "--mm-events-endpoint", mm]
    env = {"OMP_NUM_THREADS": "1", "MMIS_FRONTEND_INTERNAL_TOKEN": TOKEN}
    proc = Proc("tenancy-serve", args, tmp_path_factory.mktemp("tenancy"), env, announces=True)
    tap = EventTap([kv, mm])
    try:
        proc.wait_http("/ready", 300)
        running = Server(proc, ops_port, tap)
        # the subscription is live once a fresh image's events arrive (a SUB socket misses
        # what is published before its subscription reached the engine: send until heard)
        for shade in range(1, 30):
            ask(running.alice, with_data((shade, 2, 3)))
            try:
                wait_until("the event tap hears the engine", lambda: tap.frames, 2, proc)
                break
            except TimeoutError:
                continue
        assert tap.frames, "the event tap never heard the engine"
        yield running
    finally:
        tap.close()
        proc.stop()


def with_data(color: tuple[int, int, int], uuid: str | None = None) -> dict[str, Any]:
    inner: dict[str, Any] = {"url": image_url(color)}
    if uuid is not None:
        inner["uuid"] = uuid
    return {"type": "image_url", "image_url": inner}


def by_uuid(uuid: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"uuid": uuid}}


def messages(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]


def ask(client: openai.OpenAI, part: dict[str, Any]) -> str:
    """The greedy answer to one image (8 tokens, end-of-sequence ignored: comparable)."""
    done = client.chat.completions.create(
        model="tiny",
        messages=messages(part),  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = done.choices[0].message.content
    assert text is not None
    return text


def refused(client: openai.OpenAI, part: dict[str, Any]) -> dict[str, Any]:
    """The error body of a request that must be the uuid-only 422."""
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        ask(client, part)
    body = caught.value.body
    assert isinstance(body, dict)
    error: dict[str, Any] = body.get("error", body)
    return error


def test_another_tenant_can_neither_read_nor_poison_an_image_by_its_uuid(server: Server) -> None:
    alice_first = ask(server.alice, with_data(RED, PASSPORT))
    # Bob names Alice's uuid: his tenant has no such binding, the 422 of an unknown uuid
    error = refused(server.bob, by_uuid(PASSPORT))
    assert error["code"] == "multimodal_cache_miss" and error["retryable"] is True
    assert error["missing_uuids"] == [PASSPORT]
    # Bob sends his own image under the same uuid: it names HIS image, for him only
    bob_reference = ask(server.bob, with_data(BLUE))
    assert bob_reference != alice_first, "the tiny model must tell these images apart"
    assert ask(server.bob, with_data(BLUE, PASSPORT)) == bob_reference
    assert ask(server.bob, by_uuid(PASSPORT)) == bob_reference
    # ...and Alice's uuid still names Alice's image: the poison failed
    assert ask(server.alice, by_uuid(PASSPORT)) == alice_first
    assert ask(server.alice, with_data(RED)) == alice_first  # same content, same answer


def test_new_data_under_a_bound_uuid_rebinds_it_for_its_tenant(server: Server) -> None:
    uuid = "scan-to-replace"
    first = ask(server.alice, with_data(GREEN, uuid))
    before = server.rebinds()
    again = ask(server.alice, with_data(GREEN, uuid))  # the same data: no rebind
    assert again == first and server.rebinds() == before
    second = ask(server.alice, with_data(YELLOW, uuid))
    assert second != first, "the tiny model must tell these images apart"
    assert server.rebinds() == before + 1
    assert ask(server.alice, by_uuid(uuid)) == second  # the uuid follows the new data
    refused(server.bob, by_uuid(uuid))  # and still names nothing for Bob


def test_the_uuid_never_leaves_the_front_end(server: Server) -> None:
    uuid = "never-leaves-p0-42"
    ask(server.alice, with_data((90, 10, 140), uuid))
    ask(server.alice, by_uuid(uuid))
    refused(server.bob, by_uuid(uuid))
    internal = {"Authorization": f"Bearer {TOKEN}"}
    full = httpx.post(
        server.ops + "/internal/block_keys",
        json={"model": "tiny", "messages": messages(with_data((90, 10, 140), uuid))},
        headers=internal,
        timeout=60,
    ).json()
    assert len(full["mm_hashes"]) == 1 and uuid not in str(full)
    # a uuid-only item on the internal route: no tenant can be named there (the API keys'
    # Authorization carries the internal token), so the item is left out and the keys stop
    # where it starts
    partial = httpx.post(
        server.ops + "/internal/block_keys",
        json={"model": "tiny", "messages": messages(by_uuid(uuid))},
        headers=internal,
        timeout=60,
    ).json()
    assert partial["mm_hashes"] == [] and uuid not in str(partial)
    assert partial["prompt_tokens"] < full["prompt_tokens"]
    assert partial["block_keys"] == full["block_keys"][: len(partial["block_keys"])]
    # what P1 announced, from the start of the module: content hashes, never a uuid
    ask(server.alice, with_data((91, 11, 141)))  # one more event after the ones above
    assert server.tap.frames, "the tap heard nothing"
    for secret in (uuid, PASSPORT, "scan-to-replace"):
        assert not any(secret.encode() in frame for frame in server.tap.frames), secret
        assert secret not in server.proc.log_path.read_text(errors="replace"), secret


def test_bindings_are_bounded_and_tenants_are_digests() -> None:
    table = UuidBindings(capacity=2)
    assert table.bind("t1", "image", "u", "h1") is False
    assert table.bind("t2", "image", "u", "h2") is False  # another tenant: its own binding
    assert table.resolve("t1", "image", "u") == "h1"  # now the newest
    assert table.bind("t1", "image", "v", "h3") is False  # evicts the oldest: t2's u
    assert len(table) == 2 and table.resolve("t2", "image", "u") is None
    assert table.bind("t1", "image", "u", "h4") is True  # new content under a bound uuid
    assert table.resolve(None, "image", "u") is None  # no tenant: nothing resolves
    assert table.resolve("t1", "video", "u") is None  # bound as an image only
    tenant = key_tenant(KEY_A)
    assert KEY_A not in tenant and tenant != key_tenant(KEY_B)
