"""Acknowledgement through the shared ack words, ring-order reclamation, bounded waits."""

from __future__ import annotations

import numpy as np
import pytest

from mmis.shm import ShmReader, ShmStoreFullError, StaleHandleError


def blob(nbytes: int, fill: int = 0) -> dict[str, np.ndarray]:
    return {"b": np.full(nbytes, fill % 256, dtype=np.uint8)}


def test_reclaim_follows_ring_order(make_writer) -> None:
    writer = make_writer(capacity=1 << 16)
    first, second = writer.put(blob(1000)), writer.put(blob(1000))
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        assert reader.ack(second)
        assert writer.reclaim() == 0  # the oldest is still unacknowledged
        assert writer.stats().live_handles == 2
        assert reader.ack(first)
        assert writer.reclaim() > 0
    stats = writer.stats()
    assert (stats.used, stats.live_handles, stats.reclaimed_handles) == (0, 0, 2)
    assert stats.reclaimed_bytes >= 2000


def test_every_issued_descriptor_needs_its_own_ack(make_writer) -> None:
    writer = make_writer()
    address = writer.put(blob(100))
    assert writer.share(address) == address  # a later cache hit sends it again
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        assert reader.ack(address)
        assert writer.reclaim() == 0
        assert writer.stats().outstanding_descriptors == 1
        assert reader.ack(address)
    assert writer.reclaim() > 0
    assert writer.stats().used == 0


def test_reclaimed_handle_is_stale_for_reader_and_writer(make_writer) -> None:
    writer = make_writer()
    address = writer.put(blob(100, 7))
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        assert reader.ack(address)
        writer.reclaim()
        with pytest.raises(StaleHandleError, match="reclaimed or expired"):
            reader.read(address)
        assert reader.ack(address) is False  # a late ack changes nothing
        with pytest.raises(StaleHandleError):
            writer.share(address)


def test_full_store_raises_instead_of_blocking(make_writer) -> None:
    writer = make_writer(capacity=4096, expire_after_s=60.0)
    writer.put(blob(3000))
    with pytest.raises(ShmStoreFullError, match="send the payload inline"):
        writer.put(blob(3000))
    assert writer.stats().live_handles == 1


def test_slot_table_exhaustion_is_store_full(make_writer) -> None:
    writer = make_writer(max_handles=2)
    writer.put(blob(10))
    writer.put(blob(10))
    with pytest.raises(ShmStoreFullError):
        writer.put(blob(10))


def test_force_expiry_of_old_unacked_handles(make_writer, clock) -> None:
    writer = make_writer(capacity=4096, expire_after_s=30.0, clock=clock)
    old = writer.put(blob(1500, 1))
    clock.now += 20
    young = writer.put(blob(1500, 2))
    clock.now += 15  # old is 35 s old, young 15 s
    replacement = writer.put(blob(1500, 3))  # needs the old one's space
    stats = writer.stats()
    assert (stats.expired_handles, stats.live_handles) == (1, 2)
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        with pytest.raises(StaleHandleError):
            reader.read(old)
        assert reader.ack(old) is False
        assert reader.read(young, copy=True)["b"][0] == 2
        assert reader.read(replacement, copy=True)["b"][0] == 3
    with pytest.raises(ShmStoreFullError):  # young is not old enough to expire
        writer.put(blob(1500, 4))


def test_bounded_wait_picks_up_an_ack_that_arrives_meanwhile(make_writer, clock) -> None:
    sleeps: list[float] = []
    acks: list[object] = []

    def sleep(seconds: float) -> None:
        # stands in for the other process: it acknowledges while the writer waits
        sleeps.append(seconds)
        clock.now += seconds
        if len(sleeps) == 2:
            reader.ack(first)
            acks.append(first)

    writer = make_writer(capacity=4096, put_timeout_s=1.0, clock=clock, sleep=sleep)
    first = writer.put(blob(3000, 1))
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        second = writer.put(blob(3000, 2))
        assert len(sleeps) == 2 and sum(sleeps) < 1.0 and acks == [first]
        assert reader.read(second, copy=True)["b"][0] == 2
    stats = writer.stats()
    assert (stats.reclaimed_handles, stats.expired_handles) == (1, 0)


def test_bounded_wait_gives_up_after_its_timeout(make_writer, clock) -> None:
    waited: list[float] = []

    def sleep(seconds: float) -> None:
        waited.append(seconds)
        clock.now += seconds

    writer = make_writer(capacity=4096, put_timeout_s=0.5, clock=clock, sleep=sleep)
    writer.put(blob(3000))
    with pytest.raises(ShmStoreFullError):
        writer.put(blob(3000))
    assert sum(waited) == pytest.approx(0.5)


def test_wrap_around_keeps_contents_intact(make_writer) -> None:
    rng = np.random.default_rng(0)
    writer = make_writer(capacity=1 << 14, max_handles=64)
    live: list[tuple[object, int]] = []
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        for i in range(400):
            payload = blob(int(rng.integers(1, 5000)), i)
            while True:
                try:
                    address = writer.put(payload)
                    break
                except ShmStoreFullError:
                    # drain the oldest: the ring must make room once enough is acked
                    assert live, "store full while nothing is live"
                    addr, fill = live.pop(0)
                    assert np.all(reader.read(addr, copy=True)["b"] == fill % 256)
                    reader.ack(addr)
            live.append((address, i))
        for addr, fill in live:
            assert np.all(reader.read(addr, copy=True)["b"] == fill % 256)
            reader.ack(addr)
    writer.reclaim()
    stats = writer.stats()
    assert (stats.used, stats.live_handles, stats.expired_handles) == (0, 0, 0)
    assert stats.reclaimed_handles == 400


def test_a_put_that_fails_mid_copy_leaks_nothing(make_writer, monkeypatch) -> None:
    from mmis.shm import payload as payload_module

    writer = make_writer(capacity=8192)
    real_write = payload_module.write

    def broken_write(*args: object) -> None:
        raise OSError("simulated fault while copying into the mapping")

    monkeypatch.setattr(payload_module, "write", broken_write)
    with pytest.raises(OSError, match="simulated"):
        writer.put(blob(6000))
    monkeypatch.setattr(payload_module, "write", real_write)
    address = writer.put(blob(6000, 9))  # only fits if the failed extent was given back
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        assert reader.read(address, copy=True)["b"][0] == 9
        reader.ack(address)
    writer.reclaim()
    stats = writer.stats()
    assert (stats.used, stats.live_handles, stats.reclaimed_handles) == (0, 0, 2)
