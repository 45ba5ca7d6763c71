"""The encoder's ROUTER loop (``engine/encoder/server.py``) alone: a real ROUTER and a real
DEALER over ``inproc://`` (a sent message is in the ROUTER's pipe when ``send`` returns, so
what "arrived while a batch ran" is exact), a stand-in for the vision tower (``rows`` rows
per item; it records each call). What the real model adds is in ``test_encoder_process.py``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import zmq
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mmis.engine.encoder.output_cache import OutputCache
from mmis.engine.encoder.server import ATTR_ITEMS, SPAN_NAME, EncoderServer
from mmis.protocol.codec import WireCodec
from mmis.protocol.encoder import EncodeItem, EncodeReply, EncodeRequest, EncoderKey
from mmis.telemetry.tracing import inject, setup_tracing
from mmis.telemetry.tracing_config import TracingConfig

KEY = EncoderKey("m", "", "float32")
CODEC = WireCodec()
_NAMES = itertools.count()


class Tower:
    """Stands in for ``encode_images``: item ``rows`` -> ``[rows, 4]``; the first call waits
    until :attr:`go` is set (so requests pile up behind it); an item with ``bad`` raises."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.started = threading.Event()
        self.go = threading.Event()

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> list[Any]:
        self.calls.append([int(item["rows"][0]) for item in items])
        self.started.set()
        assert self.go.wait(10)
        if any("bad" in item for item in items):
            raise ValueError("a bad item")
        return [np.full((int(item["rows"][0]), 4), item["rows"][0], np.float32) for item in items]


def item(name: str, rows: int = 2, **extra: Any) -> EncodeItem:
    data = {"rows": np.array([rows]), **extra}
    return EncodeItem(mm_hash=name, placeholder_length=rows, data=data)


class Running:
    def __init__(self, tower: Tower, **kwargs: Any) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.cache = OutputCache(1 << 20)
        self.server = EncoderServer(
            tower,
            KEY,
            self.cache,
            endpoint=f"inproc://encoder-{next(_NAMES)}",
            ctx=self.ctx,
            **kwargs,
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.server.endpoint)

    def send(self, request: EncodeRequest) -> None:
        self.dealer.send_multipart(CODEC.encode(request))

    def replies(self, count: int) -> dict[int, EncodeReply]:
        got: dict[int, EncodeReply] = {}
        for _ in range(count):
            assert self.dealer.poll(10_000), f"only {len(got)} of {count} replies"
            reply = CODEC.decode(self.dealer.recv_multipart(), EncodeReply)
            assert reply.request_id not in got, "a request answered twice"
            got[reply.request_id] = reply
        assert not self.dealer.poll(100), "more replies than requests"
        return got

    def close(self) -> None:
        self.server.stop()
        self.thread.join(5)
        self.dealer.close()
        self.server.close()
        self.ctx.term()


@pytest.fixture
def tower() -> Tower:
    return Tower()


@pytest.fixture
def running(tower: Tower) -> Iterator[Running]:
    run = Running(tower, max_batch_items=3)
    yield run
    run.close()


def test_batches_gather_what_arrived_while_the_previous_one_ran(
    tower: Tower, running: Running
) -> None:
    running.send(EncodeRequest(1, KEY, [item("a", 1)]))
    assert tower.started.wait(10)  # "a" is being encoded; the rest queue behind it
    running.send(EncodeRequest(2, KEY, [item("b", 2), item("c", 3)]))
    running.send(EncodeRequest(3, KEY, [item("b", 2)]))  # a twin of a queued item
    running.send(EncodeRequest(4, KEY, [item("d", 4), item("e", 5)]))
    running.send(EncodeRequest(5, KEY))  # a ping is not held up by the queue... once read
    tower.go.set()
    replies = running.replies(5)
    # one call per batch, at most max_batch_items distinct items, in arrival order
    assert tower.calls == [[1], [2, 3, 4], [5]]
    assert [(i.mm_hash, i.cached, i.embeds.shape) for i in replies[2].items] == [
        ("b", False, (2, 4)),
        ("c", False, (3, 4)),
    ]
    assert [(i.mm_hash, i.cached) for i in replies[3].items] == [("b", True)]
    assert [i.mm_hash for i in replies[4].items] == ["d", "e"]
    assert replies[5].items == [] and replies[5].key == KEY
    assert running.server.counters.encoded == 5 and running.server.counters.cached == 1
    # a repeat is answered from the cache, with no call
    running.send(EncodeRequest(6, KEY, [item("c", 3)]))
    (cached,) = running.replies(1)[6].items
    assert cached.cached and np.array_equal(cached.embeds, np.full((3, 4), 3, np.float32))
    assert len(tower.calls) == 3


def test_a_bad_item_spoils_only_itself_and_wrong_rows_are_an_error(
    tower: Tower, running: Running
) -> None:
    tower.go.set()
    wrong_rows = EncodeItem(mm_hash="w", placeholder_length=7, data={"rows": np.array([2])})
    running.send(EncodeRequest(1, KEY, [item("ok", 2), item("bad", 2, bad=np.ones(1)), wrong_rows]))
    (reply,) = running.replies(1).values()
    ok, bad, wrong = reply.items
    assert ok.error is None and ok.embeds.shape == (2, 4)
    assert bad.error is not None and bad.error.code == "invalid_request"
    assert "a bad item" in bad.error.message
    assert wrong.error is not None and "placeholder_length is 7" in wrong.error.message
    assert tower.calls == [[2, 2, 2], [2], [2], [2]]  # the batch, then one by one
    assert (KEY, "w") not in running.cache  # a wrong output is never stored


def test_a_message_over_the_size_limit_is_dropped_and_the_loop_goes_on(tower: Tower) -> None:
    run = Running(tower, max_message_bytes=10_000)
    try:
        body, *_ = CODEC.encode(EncodeRequest(1, KEY, [item("x")]))
        run.dealer.send_multipart([body, b"\0" * 6000, b"\0" * 6000])  # 12 kB in three frames
        run.send(EncodeRequest(2, KEY))
        assert list(run.replies(1)) == [2]
        assert run.server.counters.oversized == 1 and tower.calls == []
    finally:
        run.close()


def test_one_encode_span_per_batch_linked_to_each_request(tower: Tower) -> None:
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(TracingConfig(), exporter=exporter)
    run = Running(tower, tracing=tracing)
    try:
        contexts = []
        for name in ("p", "q"):
            with tracing.span(f"request {name}") as parent:
                contexts.append(parent.get_span_context())
                run.send(EncodeRequest(len(contexts), KEY, [item(name)], trace_context=inject()))
            if name == "p":
                assert tower.started.wait(10)
        tower.go.set()
        run.replies(2)
    finally:
        run.close()
        tracing.shutdown()
    spans = [s for s in exporter.get_finished_spans() if s.name == SPAN_NAME]
    assert [s.attributes[ATTR_ITEMS] for s in spans] == [1, 1]
    for span, parent in zip(spans, contexts, strict=True):
        assert span.parent is not None and span.parent.span_id == parent.span_id
        assert [link.context.span_id for link in span.links] == [parent.span_id]
        assert span.context.trace_id == parent.trace_id
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_pings_and_cached_items_are_answered_while_a_batch_runs(
    tower: Tower, running: Running
) -> None:
    running.cache.put(KEY, "seen", np.zeros((2, 4), np.float32), 32)
    running.send(EncodeRequest(1, KEY, [item("slow", 1)]))
    assert tower.started.wait(10)  # the tower is busy with "slow" and will not return
    running.send(EncodeRequest(2, KEY))  # a ping: P0 drops an encoder that misses 2 s of them
    running.send(EncodeRequest(3, KEY, [item("seen", 2)]))
    early = running.replies(2)
    assert early[2].items == [] and [i.cached for i in early[3].items] == [True]
    tower.go.set()
    assert [i.mm_hash for i in running.replies(1)[1].items] == ["slow"]


def test_waiting_counts_the_running_batch_and_the_queue(tower: Tower, running: Running) -> None:
    """``mmis_encoder_queue_items`` (the encoder autoscaler's metric) reads this."""
    running.send(EncodeRequest(1, KEY, [item("a", 1)]))
    assert tower.started.wait(10)
    running.send(EncodeRequest(2, KEY, [item("b", 2), item("c", 3)]))
    running.send(EncodeRequest(3, KEY))  # once the ping is answered, b and c are queued
    running.replies(1)
    assert running.server.waiting == 3
    tower.go.set()
    running.replies(2)
    assert running.server.waiting == 0
