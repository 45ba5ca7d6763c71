"""P1's per-client backlog of receiver-cache news (``engine/output_channel.py``), no sockets.

What every client has not heard yet is attached to its next batch; the backlog keeps one
record per hash (the last event wins), never returns a client's own stores to it, and stays
bounded whatever a slow or gone client does: past ``MAX_BACKLOG`` records, or after
``CLIENT_TTL_S`` of silence, the client gets one ``shadow_reset`` instead.
"""

from __future__ import annotations

from mmis.engine import output_channel
from mmis.engine.output_channel import CLIENT_TTL_S, MAX_BACKLOG, OutputChannel
from mmis.protocol.messages import CachedItem, EngineCoreOutputs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def item(h: str) -> CachedItem:
    return CachedItem(h, 100, 4)


def heard(channel: OutputChannel, client: int) -> EngineCoreOutputs:
    batch = EngineCoreOutputs()
    channel.attach_backlog(client, batch)
    return batch


def channel_with(*clients: int, clock: Clock | None = None) -> OutputChannel:
    channel = OutputChannel(cache_epoch="e", clock=clock or Clock())
    for client in clients:
        channel.register(client)
        heard(channel, client)  # the first registration's reset is consumed
    return channel


def test_stores_go_to_every_other_client_evictions_to_all() -> None:
    channel = channel_with(0, 1, 2)
    channel.publish([item("x"), item("y")], ["old"], origin=0)
    mine, other = heard(channel, 0), heard(channel, 1)
    assert mine.stored_mm_items == [] and mine.evicted_mm_hashes == ["old"]
    assert other.stored_mm_items == [item("x"), item("y")]
    assert other.evicted_mm_hashes == ["old"] and not other.shadow_reset
    assert [i.mm_hash for i in heard(channel, 2).stored_mm_items] == ["x", "y"]
    assert heard(channel, 1) == EngineCoreOutputs()  # heard once: nothing twice


def test_the_last_event_per_hash_wins() -> None:
    channel = channel_with(0, 1)
    channel.publish([item("x")], [], origin=0)
    channel.publish([], ["x"])  # stored, then evicted: the client only needs the eviction
    channel.publish([item("y")], [], origin=0)
    channel.publish([], ["z"])
    channel.publish([item("z")], [], origin=0)  # evicted, then stored again
    batch = heard(channel, 1)
    assert batch.evicted_mm_hashes == ["x"]
    assert [i.mm_hash for i in batch.stored_mm_items] == ["y", "z"]


def test_a_slow_client_overflows_into_one_reset_and_memory_stays_bounded(monkeypatch) -> None:
    monkeypatch.setattr(output_channel, "MAX_BACKLOG", 8)
    channel = channel_with(0, 1)
    for i in range(50):
        channel.publish([item(f"h{i}")], [f"e{i}"], origin=0)
        assert channel.backlog_size(1) <= 8
        heard(channel, 0)  # the busy client hears everything as it goes
    batch = heard(channel, 1)
    assert batch.shadow_reset is True
    assert batch.stored_mm_items == [] and batch.evicted_mm_hashes == []
    channel.publish([item("fresh")], [], origin=0)  # after the reset, news is kept again
    assert [i.mm_hash for i in heard(channel, 1).stored_mm_items] == ["fresh"]


def test_a_silent_client_is_forgotten_and_reset_when_it_comes_back() -> None:
    clock = Clock()
    channel = channel_with(0, 1, clock=clock)
    channel.publish([item("x")], [], origin=0)
    assert channel.backlog_size(1) == 1
    clock.now += CLIENT_TTL_S + 1
    channel.register(0)  # client 0's heartbeat: client 1 said nothing for too long
    assert channel.backlog_size(1) == 0
    channel.publish([item("y")], [], origin=0)
    assert channel.backlog_size(1) == 0  # a forgotten client accumulates nothing
    channel.register(1)
    batch = heard(channel, 1)
    assert batch.shadow_reset is True and batch.stored_mm_items == []


def test_a_live_client_is_never_forgotten() -> None:
    clock = Clock()
    channel = channel_with(0, 1, clock=clock)
    for _ in range(5):
        clock.now += CLIENT_TTL_S / 2
        channel.register(0)
        channel.register(1)
    channel.publish([item("x")], [], origin=0)
    batch = heard(channel, 1)
    assert not batch.shadow_reset and [i.mm_hash for i in batch.stored_mm_items] == ["x"]


def test_resync_sends_a_reset_and_the_snapshot_newest_last(monkeypatch) -> None:
    monkeypatch.setattr(output_channel, "MAX_BACKLOG", 3)
    channel = channel_with(0, 1)
    channel.publish([], ["stale"])
    channel.resync(1, [item("a"), item("b"), item("c"), item("d")])
    batch = heard(channel, 1)
    assert batch.shadow_reset is True and batch.evicted_mm_hashes == []
    assert [i.mm_hash for i in batch.stored_mm_items] == ["b", "c", "d"]


def test_forget_all_drops_old_epoch_news() -> None:
    channel = channel_with(0, 1)
    channel.publish([item("x")], ["y"], origin=0)
    channel.forget_all()
    assert heard(channel, 1) == EngineCoreOutputs()


def test_evictions_before_any_client_is_known_are_kept_for_client_0() -> None:
    channel = OutputChannel(cache_epoch="e")
    channel.publish([item("x")], ["y"])
    batch = heard(channel, 0)
    assert batch.evicted_mm_hashes == ["y"] and batch.stored_mm_items == [item("x")]
    assert MAX_BACKLOG >= 1024  # a whole sync snapshot of a typical cache fits
