"""P0's encoder pool (E/PD, issue 46): rendezvous hashing, the live set, fetch and fallbacks.

Real ZMQ: each fake encoder is a ROUTER in the test's event loop answering the pool's DEALER
with WireCodec-encoded :class:`EncodeReply` messages (the contract of ``mmis encoder``), in
one of several behaviours (healthy, silent, mislabelled, ...)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zmq
import zmq.asyncio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from PIL import Image

from mmis.frontend.client import rendezvous
from mmis.frontend.client.encoder_pool import EncoderPool, EncoderPoolError
from mmis.frontend.client.media import MediaLoader
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.frontend.client.processor import ModelProcessor
from mmis.frontend.client.renderer import Renderer, SourceItem, SourcePrompt
from mmis.frontend.config import FrontendConfig
from mmis.multimodal.cache import SenderCache, item_nbytes
from mmis.protocol.codec import WireCodec
from mmis.protocol.encoder import (
    MM_EMBEDS,
    EncodedItem,
    EncodeItem,
    EncodeReply,
    EncodeRequest,
    EncoderKey,
)
from mmis.protocol.messages import RequestError
from mmis.telemetry import catalog
from mmis.telemetry.metrics import MMISMetrics
from mmis.tiny_models.tiny_model import tiny_model_dir

KEY = EncoderKey("tiny-llava", "", "")  # P0's: the model and revision; the dtype is learnt
SERVED = EncoderKey("tiny-llava", "", "float32")  # what the encoders answer with
HIDDEN = 4


# ---------------------------------------------------------------------- rendezvous


def test_rendezvous_is_stable_and_order_free() -> None:
    nodes = [f"tcp://10.0.0.{i}:5570" for i in range(5)]
    for k in range(200):
        key = f"hash-{k}"
        first = rendezvous.pick(key, nodes)
        assert first == rendezvous.pick(key, list(reversed(nodes)))
        assert first == rendezvous.pick(key, sorted(nodes, key=lambda n: rendezvous.weight(n, "x")))
    assert rendezvous.pick("k", []) is None
    # a fixed value: the weight is no salted hash(), so every P0 agrees across processes
    assert rendezvous.weight("tcp://a:1", "k") == rendezvous.weight("tcp://a:1", "k")
    assert rendezvous.weight("tcp://a:1", "k") != rendezvous.weight("tcp://a:2", "k")


def test_rendezvous_moves_only_the_keys_of_a_node_that_leaves_or_joins() -> None:
    nodes = [f"tcp://enc-{i}:5570" for i in range(4)]
    keys = [f"{k:064x}" for k in range(4000)]
    before = {k: rendezvous.pick(k, nodes) for k in keys}
    gone = nodes[1]
    after = {k: rendezvous.pick(k, [n for n in nodes if n != gone]) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone}
    joined = {k: rendezvous.pick(k, [*nodes, "tcp://enc-new:5570"]) for k in keys}
    assert all(joined[k] in (before[k], "tcp://enc-new:5570") for k in keys)


def test_rendezvous_spreads_keys_uniformly() -> None:
    nodes = [f"tcp://enc-{i}:5570" for i in range(4)]
    counts = collections.Counter(rendezvous.pick(f"img-{k}", nodes) for k in range(8000))
    assert set(counts) == set(nodes)
    assert all(1700 <= c <= 2300 for c in counts.values()), counts  # 2000 each, ~4.5 sigma


# ---------------------------------------------------------------------- fake encoders


class FakeEncoder:
    """A ROUTER answering like ``mmis encoder``: a request under another key than ``served``
    is a whole-request error carrying ``served``. ``mode``: ok | silent (answers nothing) |
    mute_items (answers pings only) | wrong_key | wrong_hash | error."""

    def __init__(
        self, ctx: zmq.asyncio.Context, mode: str = "ok", served: EncoderKey = SERVED
    ) -> None:
        self.mode = mode
        self.served = served
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.codec = WireCodec()
        self.requests: list[EncodeRequest] = []  # item requests only
        self.identity: bytes | None = None  # the pool's DEALER, once it asked anything
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, *frames = await self.sock.recv_multipart(copy=False)
            request = self.codec.decode([f.buffer for f in frames], EncodeRequest)
            if request.items:
                self.requests.append(request)
            if self.mode == "silent" or (self.mode == "mute_items" and request.items):
                continue
            reply = EncodeReply(request.request_id, self.served, [])
            if request.key != self.served:
                reply.error = RequestError("invalid_request", "the request's key differs")
                await self.sock.send_multipart([identity.bytes, *self.codec.encode(reply)])
                continue
            if self.mode == "wrong_key":
                reply.key = EncoderKey("another-model")
            if self.mode == "error" and request.items:
                reply.error = RequestError("encoder_failed", "the vision tower failed")
            for k, item in enumerate(request.items if self.mode != "error" else []):
                rows = np.full((item.placeholder_length, HIDDEN), len(self.requests), np.float32)
                name = item.mm_hash + "x" if self.mode == "wrong_hash" else item.mm_hash
                embeds: object = rows
                if self.mode == "bad_embeds":  # not relayable: P0 must not pass them to P1
                    embeds = ["a string", rows[None], rows[1:], {"x": 1}, rows.astype(np.bool_)][
                        k % 5
                    ]
                reply.items.append(EncodedItem(mm_hash=name, embeds=embeds))
            self.identity = identity.bytes
            await self.sock.send_multipart([identity.bytes, *self.codec.encode(reply)])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close(linger=0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def make_pool(urls: list[str], **kw: object) -> EncoderPool:
    pool = EncoderPool(
        KEY,
        urls=urls,
        metrics=MMISMetrics("tiny-llava"),
        ping_interval_s=0.05,
        down_after_s=0.3,
        **kw,  # type: ignore[arg-type]
    )
    await pool.start()
    return pool


async def until(predicate: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def items(n: int) -> list[EncodeItem]:
    return [
        EncodeItem(
            mm_hash=f"{k:064x}",
            placeholder_length=3 + k % 2,
            data={"pixel_values": np.ones((1, 3, 2, 2), np.float32)},
        )
        for k in range(n)
    ]


def fallbacks(pool: EncoderPool, reason: str) -> float:
    assert pool.metrics is not None
    return pool.metrics.total(catalog.ENCODER_FALLBACKS, reason=reason)


# ---------------------------------------------------------------------- the pool


async def test_fetch_asks_each_items_owner_once_and_returns_its_output(
    ctx: zmq.asyncio.Context,
) -> None:
    encoders = [FakeEncoder(ctx), FakeEncoder(ctx)]
    pool = await make_pool([e.url for e in encoders])
    try:
        await until(lambda: len(pool.live()) == 2)
        asked = items(12)
        got = await pool.fetch(asked, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
        assert got.fallbacks == {}
        assert set(got.embeds) == {i.mm_hash for i in asked}
        for item in asked:
            assert got.embeds[item.mm_hash].shape == (item.placeholder_length, HIDDEN)
        for enc in encoders:
            assert len(enc.requests) == 1  # one EncodeRequest per encoder
            sent = {i.mm_hash for i in enc.requests[0].items}
            assert sent == {i.mm_hash for i in asked if pool.owner(i.mm_hash) == enc.url}
            assert sent  # 12 items over 2 encoders: both own some
            assert enc.requests[0].trace_context["traceparent"].startswith("00-1111")
            assert "pixel_values" in enc.requests[0].items[0].data
        assert pool.metrics is not None
        assert pool.metrics.total(catalog.ENCODER_REQUESTS, outcome="ok") == 12
    finally:
        await pool.close()
        for enc in encoders:
            await enc.close()


async def test_a_silent_encoder_leaves_the_set_its_items_move_and_it_comes_back(
    ctx: zmq.asyncio.Context,
) -> None:
    a, b = FakeEncoder(ctx), FakeEncoder(ctx)
    pool = await make_pool([a.url, b.url])
    try:
        await until(lambda: len(pool.live()) == 2)
        asked = items(16)
        owned_by_a = {i.mm_hash for i in asked if pool.owner(i.mm_hash) == a.url}
        a.mode = "silent"
        await until(lambda: pool.live() == [b.url], timeout=2.0)  # out within down_after_s
        got = await pool.fetch(asked)
        assert got.fallbacks == {} and set(got.embeds) == {i.mm_hash for i in asked}
        moved = {i.mm_hash for i in b.requests[-1].items}
        assert owned_by_a <= moved  # a's items went to b
        a.mode = "ok"
        await until(lambda: len(pool.live()) == 2)  # back as soon as it answers
        assert {i.mm_hash for i in asked if pool.owner(i.mm_hash) == a.url} == owned_by_a
    finally:
        await pool.close()
        await a.close()
        await b.close()


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("mute_items", "timeout"),
        ("wrong_key", "mislabelled"),
        ("wrong_hash", "mislabelled"),
        ("error", "error"),
    ],
)
async def test_an_unusable_answer_is_a_counted_fallback_on_the_span(
    ctx: zmq.asyncio.Context, mode: str, reason: str
) -> None:
    enc = FakeEncoder(ctx, mode="ok")
    pool = await make_pool([enc.url], timeout_s=0.3)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        await until(lambda: pool.live() == [enc.url])
        enc.mode = mode
        asked = items(3)
        start = asyncio.get_running_loop().time()
        with provider.get_tracer("t").start_as_current_span("render"):
            got = await pool.fetch(asked)
        assert asyncio.get_running_loop().time() - start < 2.0
        assert got.embeds == {}  # nothing mislabelled is ever relayed
        assert got.fallbacks == {i.mm_hash: reason for i in asked}
        assert fallbacks(pool, reason) == 3
        assert pool.metrics is not None
        assert pool.metrics.total(catalog.ENCODER_REQUESTS, outcome="fallback") == 3
        (span,) = exporter.get_finished_spans()
        events = [(e.name, dict(e.attributes or {})) for e in span.events]
        assert events == [
            ("encoder_fallback", {"mmis.encoder.reason": reason, "mmis.mm.hashes_count": 3})
        ]
    finally:
        await pool.close()
        await enc.close()


async def test_no_live_encoder_and_a_dead_one_fall_back_at_once(ctx: zmq.asyncio.Context) -> None:
    enc = FakeEncoder(ctx, mode="silent")
    pool = await make_pool([enc.url], timeout_s=5.0)
    try:
        start = asyncio.get_running_loop().time()
        got = await pool.fetch(items(2))
        assert asyncio.get_running_loop().time() - start < 0.5  # no wait on the timeout
        assert set(got.fallbacks.values()) == {"none_live"}
        assert fallbacks(pool, "none_live") == 2
        assert await pool.fetch([]) == type(got)({}, {})
    finally:
        await pool.close()
        await enc.close()


async def test_an_encoder_that_goes_silent_mid_fetch_is_down_before_the_timeout(
    ctx: zmq.asyncio.Context,
) -> None:
    enc = FakeEncoder(ctx)
    pool = await make_pool([enc.url], timeout_s=10.0)
    try:
        await until(lambda: pool.live() == [enc.url])
        enc.mode = "silent"
        start = asyncio.get_running_loop().time()
        got = await pool.fetch(items(2))
        assert asyncio.get_running_loop().time() - start < 3.0  # ~down_after_s, not 10 s
        assert set(got.fallbacks.values()) == {"down"}
    finally:
        await pool.close()
        await enc.close()


async def test_token_makes_a_plain_client_the_engine_zap_handler_admits(
    ctx: zmq.asyncio.Context,
) -> None:
    from mmis.engine.event_auth import USER, ZapHandler, secure_server
    from mmis.protocol.zmq_auth import PLAIN_USER

    assert PLAIN_USER == USER
    sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
    zap = ZapHandler.acquire(sync_ctx, b"s3cret")
    enc = FakeEncoder.__new__(FakeEncoder)
    enc.mode, enc.served, enc.codec, enc.requests = "ok", SERVED, WireCodec(), []
    enc.sock = ctx.socket(zmq.ROUTER)
    enc.sock.setsockopt(zmq.LINGER, 0)
    secure_server(enc.sock, b"s3cret")  # type: ignore[arg-type]  # the same setsockopt
    enc.url = f"tcp://127.0.0.1:{enc.sock.bind_to_random_port('tcp://127.0.0.1')}"
    enc.task = asyncio.get_running_loop().create_task(enc._serve())
    good = await make_pool([enc.url], token="s3cret")
    bad = await make_pool([enc.url], token="wrong")
    try:
        await until(lambda: good.live() == [enc.url])
        await asyncio.sleep(0.4)
        assert bad.live() == []
        assert zap.refused >= 1
    finally:
        await good.close()
        await bad.close()
        await enc.close()
        zap.release()


async def test_an_encoder_of_another_model_is_never_live(ctx: zmq.asyncio.Context) -> None:
    other = FakeEncoder(ctx, served=EncoderKey("another-model", "", "float32"))
    ours = FakeEncoder(ctx)
    pool = await make_pool([other.url, ours.url])
    try:
        await until(lambda: pool.live() == [ours.url])
        await asyncio.sleep(0.2)
        assert pool.live() == [ours.url]
        assert pool._encoders[ours.url].key == SERVED  # learnt from the answer to a ping
        got = await pool.fetch(items(4))
        assert len(got.embeds) == 4 and not other.requests
        assert all(r.key == SERVED for r in ours.requests)
    finally:
        await pool.close()
        await other.close()
        await ours.close()


async def test_a_service_name_resolves_to_its_encoders_live_from_the_start(
    ctx: zmq.asyncio.Context,
) -> None:
    enc = FakeEncoder(ctx)
    port = enc.url.rpartition(":")[2]
    pool = EncoderPool(KEY, service=f"localhost:{port}", ping_interval_s=0.05, down_after_s=1.0)
    await pool.start()
    try:
        assert enc.url in pool.members()  # localhost's A record, as tcp://ADDR:PORT
        assert enc.url in pool.live()  # start() waited for the first answer
    finally:
        await pool.close()
        await enc.close()


def test_bad_flags_are_refused_by_name() -> None:
    with pytest.raises(EncoderPoolError, match="--encoder-urls"):
        EncoderPool(KEY, urls=["http://x:1"])
    with pytest.raises(EncoderPoolError, match="--encoder-service"):
        EncoderPool(KEY, service="encoders")
    with pytest.raises(EncoderPoolError, match="--encoder-urls or --encoder-service"):
        EncoderPool(KEY)


# ---------------------------------------------------------------------- the renderer with encoders


@pytest.fixture(scope="module")
def tiny_processor() -> ModelProcessor:
    return ModelProcessor.from_pretrained(str(tiny_model_dir()))


@pytest.fixture
async def epd(
    ctx: zmq.asyncio.Context, tiny_processor: ModelProcessor
) -> AsyncIterator[tuple[Renderer, FakeEncoder]]:
    enc = FakeEncoder(ctx)
    pool = await make_pool([enc.url], timeout_s=0.5)
    shadow = SenderCache(1 << 30)
    executor = ThreadPoolExecutor(max_workers=1)
    r = Renderer(
        tiny_processor,
        MediaLoader(FrontendConfig()),
        shadow,
        PendingInvalidations(shadow),
        executor,
        model_id="tiny",
        max_model_len=256,
        max_images=4,
        encoders=pool,
    )
    await until(lambda: pool.live() == [enc.url])
    yield r, enc
    executor.shutdown(wait=True)
    await pool.close()
    await enc.close()


def one_image(r: Renderer, color: tuple[int, int, int] | None) -> SourcePrompt:
    content: list[dict[str, str]] = [{"type": "text", "text": "hi"}]
    if color is not None:
        content.insert(0, {"type": "image"})
    text = r.processor.chat_prompt([{"role": "user", "content": content}])
    if color is None:
        return SourcePrompt(r.processor.tokenize(text), [])
    image = Image.new("RGB", (40, 30), color)
    return SourcePrompt(
        r.processor.tokenize(text), [SourceItem(r.hash_image(image), None, image, "p")]
    )


async def test_render_sends_the_encoders_output_for_an_item_p1_lacks(
    epd: tuple[Renderer, FakeEncoder],
) -> None:
    r, enc = epd
    source = one_image(r, (1, 2, 3))
    mm_hash = source.items[0].mm_hash
    first = await r.render(source, bypass=False, reserve_tokens=1)
    (feature,) = first.features[0]
    assert isinstance(feature.data, dict)
    assert set(feature.data) == {MM_EMBEDS}  # the pixels stay in P0
    assert feature.data[MM_EMBEDS].shape == (feature.placeholder.length, HIDDEN)
    assert len(enc.requests) == 1 and enc.requests[0].items[0].mm_hash == mm_hash
    assert enc.requests[0].items[0].placeholder_length == feature.placeholder.length
    entry = r.shadow.get(mm_hash)
    assert entry is not None and entry.nbytes == item_nbytes(feature.data)  # what P1 stores
    # a shadow hit asks nobody; the drift retry (bypass) sends pixels and asks nobody
    hit = await r.render(source, bypass=False, reserve_tokens=1)
    assert hit.features[0][0].data is None
    r.pending.enqueue([mm_hash])  # P1 reported it missing: the drift retry renders it again
    retry = await r.render(source, bypass=True, reserve_tokens=1)
    assert isinstance(retry.features[0][0].data, dict)
    assert "pixel_values" in retry.features[0][0].data
    assert MM_EMBEDS not in retry.features[0][0].data
    await r.render(one_image(r, None), bypass=False, reserve_tokens=1)  # text only
    assert len(enc.requests) == 1


async def test_a_fallback_sends_pixels_and_the_worker_never_waits_on_the_encoder(
    epd: tuple[Renderer, FakeEncoder],
) -> None:
    r, enc = epd
    enc.mode = "mute_items"  # alive, never answers an item: every fetch times out
    assert r.encoders is not None
    r.encoders.timeout_s = 2.0
    loop = asyncio.get_running_loop()
    start = loop.time()
    waiting = asyncio.ensure_future(
        r.render(one_image(r, (7, 7, 7)), bypass=False, reserve_tokens=1)
    )
    await until(lambda: len(enc.requests) == 1)
    # meanwhile the single render worker renders another request at once
    text = await r.render(one_image(r, None), bypass=False, reserve_tokens=1)
    assert text.processed == 0 and not waiting.done()
    assert fallbacks(r.encoders, "timeout") == 0  # done while the fetch still waited
    rendered = await waiting
    assert loop.time() - start >= 2.0
    data = rendered.features[0][0].data
    assert isinstance(data, dict) and "pixel_values" in data and MM_EMBEDS not in data
    assert fallbacks(r.encoders, "timeout") == 1


async def test_hostile_replies_are_dropped_and_the_encoder_stays_usable(
    ctx: zmq.asyncio.Context,
) -> None:
    """Bounded, never trusting an encoder's bytes: random frames, truncated and bit-flipped
    replies are dropped and counted without ending the receive loop; outputs that are no 2-D
    numeric array of the placeholder's rows are fallbacks, never relayed."""
    enc = FakeEncoder(ctx, mode="bad_embeds")
    pool = await make_pool([enc.url])
    try:
        await until(lambda: pool.live() == [enc.url] and enc.identity is not None)
        asked = items(5)
        got = await pool.fetch(asked)
        assert got.embeds == {} and set(got.fallbacks.values()) == {"error"}
        assert enc.identity is not None
        rng = np.random.default_rng(0)
        valid = enc.codec.encode(
            EncodeReply(123456, SERVED, [EncodedItem(mm_hash="h", embeds=np.ones((2, 4)))])
        )
        body = bytes(valid[0])
        hostile: list[list[bytes]] = [
            [rng.bytes(int(n))]
            for n in rng.integers(0, 300, 40)  # random bodies
        ]
        hostile += [[body[:cut]] for cut in range(0, len(body), 7)]  # truncated
        for _ in range(40):  # bit flips of a valid reply, its tensor frame kept or dropped
            flipped = bytearray(body)
            flipped[int(rng.integers(len(flipped)))] ^= 1 << int(rng.integers(8))
            hostile.append([bytes(flipped), *[bytes(f) for f in valid[1:2] if rng.random() < 0.5]])
        hostile.append([b"\x93\x01"])  # an array header promising more than is there
        for frames in hostile:
            await enc.sock.send_multipart([enc.identity, *frames])
        await until(lambda: pool.bad_replies >= 40)
        enc.mode = "ok"
        asked = items(3)
        got = await pool.fetch(asked)
        assert got.fallbacks == {} and set(got.embeds) == {i.mm_hash for i in asked}
        assert pool.live() == [enc.url]
    finally:
        await pool.close()
        await enc.close()
