"""A real ``mmis encoder`` process per family (``conftest.py``), asked over a real ZMQ DEALER
with the token, as P0 asks it (``protocol/encoder.py``).

- its outputs are the adapter's ``encode_images`` on the same tensors (float32);
- a repeated item comes from its cache (``cached``, and ``/metrics`` counts no new encode);
- a request under another key gets a whole-request ``invalid_request`` naming the field;
- fuzzed and oversized frame sets never stop it answering pings;
- without the token (or with another) nobody gets an answer; off loopback without a token
  it refuses to start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mmis.engine.execution.encoder_sizing import load_image_processor
from mmis.engine.execution.model import ModelAdapter, load_adapter
from mmis.protocol.encoder import EncodeItem, EncodeRequest, EncoderKey
from mmis.protocol.kv_events import MM_DECODER, EpochStarted, MMItemStored
from mmis.protocol.tensors import TENSOR_EXT_CODE
from mmis.tiny_models.tiny_model import tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encoder_procs import MAX_MESSAGE_MB, MMIS, OFFLINE, Client, EncoderProc

pytestmark = [pytest.mark.model]


def key_of(family: str, dtype: str = "float32") -> EncoderKey:
    return EncoderKey(str(tiny_model_dir(family)), "", dtype)


class Reference:
    """The family's adapter and image processor in this process (float32, CPU, unfused)."""

    def __init__(self, family: str) -> None:
        path = str(tiny_model_dir(family))
        self.adapter: ModelAdapter = load_adapter(path, "cpu", torch.float32, fuse=False)
        self.processor = load_image_processor(path, None)

    def item(self, name: str, size: tuple[int, int], seed: int) -> EncodeItem:
        rng = np.random.default_rng(seed)
        image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
        batch = self.processor(images=[image], return_tensors="np")
        (data,) = self.adapter.split_processor_output(dict(batch))
        tokens = int(self.adapter.num_placeholder_tokens(data))
        return EncodeItem(mm_hash=name, placeholder_length=tokens, data=dict(data))

    @torch.inference_mode()
    def encode(self, items: list[EncodeItem]) -> list[np.ndarray]:
        return [t.numpy() for t in self.adapter.encode_images([i.data for i in items])]


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    return {family: Reference(family) for family in ("llava", "qwen2-vl")}


def metric(proc: EncoderProc, outcome: str) -> float:
    text = httpx.get(proc.root_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("mmis_encoder_items_total{") and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no mmis_encoder_items_total{{outcome={outcome}}} in\n{text}")


@pytest.mark.parametrize(
    ("family", "fixture", "sizes"),
    [
        ("llava", "llava_encoder", [(40, 30), (64, 64)]),
        ("qwen2-vl", "qwen_encoder", [(56, 56), (112, 84), (84, 140)]),
    ],
)
def test_outputs_equal_the_adapters_on_the_same_tensors(
    request: pytest.FixtureRequest,
    references: dict[str, Reference],
    family: str,
    fixture: str,
    sizes: list[tuple[int, int]],
) -> None:
    proc: EncoderProc = request.getfixturevalue(fixture)
    ref = references[family]
    items = [ref.item(f"{family}-parity-{i}", size, seed=i) for i, size in enumerate(sizes)]
    client = Client(proc.endpoint)
    try:
        reply = client.ask(EncodeRequest(client.next_id(), key_of(family), items))
    finally:
        client.close()
    assert reply is not None and reply.error is None and reply.key == key_of(family)
    expected = ref.encode(items)
    assert [i.mm_hash for i in reply.items] == [i.mm_hash for i in items]
    for got, want, item in zip(reply.items, expected, items, strict=True):
        assert got.error is None and not got.cached
        embeds = np.asarray(got.embeds)
        assert embeds.dtype == np.float32 and embeds.shape == (
            item.placeholder_length,
            want.shape[1],
        )
        np.testing.assert_allclose(embeds, want, rtol=1e-6, atol=1e-6)


def test_a_repeated_item_is_served_from_the_cache(
    llava_encoder: EncoderProc, references: dict[str, Reference], client: Client
) -> None:
    item = references["llava"].item("llava-repeat", (48, 40), seed=7)
    first = client.ask(EncodeRequest(client.next_id(), key_of("llava"), [item]))
    assert first is not None and not first.items[0].cached
    encoded, cached = metric(llava_encoder, "encoded"), metric(llava_encoder, "cached")
    again = client.ask(EncodeRequest(client.next_id(), key_of("llava"), [item]))
    assert again is not None and again.items[0].cached
    np.testing.assert_array_equal(np.asarray(again.items[0].embeds), first.items[0].embeds)
    assert metric(llava_encoder, "encoded") == encoded  # not encoded again
    assert metric(llava_encoder, "cached") == cached + 1
    assert httpx.get(llava_encoder.root_url + "/health", timeout=10).status_code == 200
    # the store was announced on its event stream (replayed from the start: mm-events format)
    events = replayed_events(llava_encoder)
    assert isinstance(events[0], EpochStarted)
    stored = [e for e in events if isinstance(e, MMItemStored)]
    assert MMItemStored(mm_hash="llava-repeat", nbytes=first.items[0].embeds.nbytes) in stored


def replayed_events(proc: EncoderProc) -> list[Any]:
    """Every event the encoder's stream still buffers, through its replay socket."""
    assert proc.events_replay is not None, "the encoder logged no event endpoints"
    client = Client(proc.events_replay)
    events: list[Any] = []
    try:
        client.send_frames([b"", (0).to_bytes(8, "big")])
        while client.sock.poll(10_000):
            _, _, seq, payload = client.sock.recv_multipart()
            if seq == b"\xff" * 8:
                return events
            events.extend(MM_DECODER.decode(payload).events)
        raise AssertionError("the replay did not end")
    finally:
        client.close()


def test_another_key_is_refused_naming_the_difference(client: Client) -> None:
    asked = key_of("llava", dtype="bfloat16")
    reply = client.ask(
        EncodeRequest(client.next_id(), asked, [EncodeItem(mm_hash="x", placeholder_length=1)])
    )
    assert reply is not None and reply.items == []
    assert reply.error is not None and reply.error.code == "invalid_request"
    assert "dtype 'bfloat16'" in reply.error.message and "'float32'" in reply.error.message
    assert reply.key == key_of("llava")  # the encoder says what it serves


def _ping(client: Client) -> None:
    reply = client.ask(EncodeRequest(client.next_id(), key_of("llava")), timeout_s=5)
    assert reply is not None and reply.error is None and reply.items == []


_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=32)
    | st.builds(lambda data: msgspec.msgpack.Ext(TENSOR_EXT_CODE, data), st.binary(max_size=24))
)
_values = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
_bodies = _values.map(msgspec.msgpack.encode) | st.builds(
    # EncodeRequest-shaped: an id, a key, items of anything
    lambda rid, items: msgspec.msgpack.encode(
        [rid, [str(tiny_model_dir("llava")), "", "float32"], items]
    ),
    st.integers(min_value=0, max_value=2**32),
    st.lists(_values, max_size=3),
)


@pytest.fixture(scope="module")
def fuzz_client(llava_encoder: EncoderProc) -> Iterator[Client]:
    c = Client(llava_encoder.endpoint)
    yield c
    c.close()


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_bodies, extra=st.lists(st.binary(max_size=64), max_size=3))
def test_malformed_frames_never_stop_it_answering(
    llava_encoder: EncoderProc, fuzz_client: Client, body: bytes, extra: list[bytes]
) -> None:
    assert llava_encoder.popen.poll() is None, "the encoder died"
    fuzz_client.send_frames([body, *extra])
    _ping(fuzz_client)


def test_an_oversized_message_is_dropped_and_it_goes_on(fuzz_client: Client) -> None:
    half = b"\0" * ((MAX_MESSAGE_MB << 20) // 2 + 4096)
    body = msgspec.msgpack.encode([1, ["m", "", "float32"], []])
    fuzz_client.send_frames([body, half, half])  # each frame under the limit, all over it
    _ping(fuzz_client)


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_a_client_without_the_token_gets_no_answer(
    llava_encoder: EncoderProc, token: str | None
) -> None:
    stranger = Client(llava_encoder.endpoint, token=token)
    try:
        assert stranger.ask(EncodeRequest(1, key_of("llava")), timeout_s=1.5) is None
    finally:
        stranger.close()


def test_off_loopback_without_a_token_it_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMIS_ENCODER_")}
    done = subprocess.run(
        [MMIS, "encoder", "--model", str(tiny_model_dir("llava")), "--endpoint", "tcp://0.0.0.0:0"],
        env={**env, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mmis encoder: --endpoint tcp://0.0.0.0:0 is not a loopback address")
    assert "MMIS_ENCODER_TOKEN" in last
    assert "ready" not in done.stdout
