"""A real second process reads descriptors written here, acks them, and we see reclamation."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from mmis.protocol.messages import ShmAddress
from mmis.shm import ShmStoreFullError, ShmWriter

CHILD = Path(__file__).with_name("reader_child.py")
_LEN = struct.Struct("<I")


class Child:
    """The reader process, driven over its stdin/stdout (blocking request/reply)."""

    def __init__(self, directory: Path, segment: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(directory), segment],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def call(self, op: str, addresses: list[ShmAddress]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        body = msgspec.msgpack.encode((op, addresses))
        self.proc.stdin.write(_LEN.pack(len(body)) + body)
        self.proc.stdin.flush()
        header = self.proc.stdout.read(_LEN.size)
        assert len(header) == _LEN.size, f"reader process died (rc={self.proc.poll()})"
        return msgspec.msgpack.decode(self.proc.stdout.read(_LEN.unpack(header)[0]))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.call("exit", []) == "bye"
            assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def pair(make_writer) -> Iterator[tuple[ShmWriter, Child]]:
    writer = make_writer(capacity=1 << 20, max_handles=16)
    child = Child(writer.directory, writer.segment)
    try:
        yield writer, child
        child.close()
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def expected(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    return {
        n: f"{a.dtype.str} {list(a.shape)} {hashlib.sha256(a.tobytes()).hexdigest()}"
        for n, a in arrays.items()
    }


def test_child_reads_acks_and_parent_reclaims_across_laps(pair, image_payload) -> None:
    writer, child = pair
    # a sliding window of ~110 KiB payloads in a 1 MiB ring: the ring never empties, so
    # allocations wrap around its end many times while the child reads and acks the oldest
    window: list[tuple[ShmAddress, dict[str, str]]] = []
    wraps, last_offset = 0, -1
    for step in range(30):
        for i in range(3):
            payload = image_payload(step * 10 + i, side=96)
            address = writer.put(payload)
            wraps += address.offset < last_offset
            last_offset = address.offset
            window.append((address, expected(payload)))
        if len(window) > 6:
            oldest, window = window[:3], window[3:]
            assert child.call("read_ack", [a for a, _ in oldest]) == [e for _, e in oldest]
            assert writer.reclaim() > 0
            assert writer.stats().live_handles == len(window)
    assert wraps >= 5
    assert child.call("read_ack", [a for a, _ in window]) == [e for _, e in window]
    writer.reclaim()
    stats = writer.stats()
    assert (stats.used, stats.live_handles, stats.reclaimed_handles) == (0, 0, 90), stats
    assert stats.expired_handles == 0


def test_without_acks_the_parent_cannot_reclaim(pair, image_payload) -> None:
    writer, child = pair
    address = writer.put(image_payload(1, side=96))
    writer.share(address)
    assert child.call("ack", [address]) == [True]
    assert writer.reclaim() == 0  # two descriptors issued, one acknowledged
    assert writer.stats().outstanding_descriptors == 1
    assert child.call("ack", [address]) == [True]
    assert writer.reclaim() > 0
    assert writer.stats().used == 0


def test_child_rejects_bad_descriptors(pair, image_payload, make_writer) -> None:
    writer, child = pair
    good = writer.put(image_payload(2))
    other = make_writer().put(image_payload(3))
    bad = [
        msgspec.structs.replace(good, signature=bytes(32)),
        msgspec.structs.replace(good, offset=good.offset + 64),
        msgspec.structs.replace(good, length=good.length + 1),
        msgspec.structs.replace(good, generation=good.generation + 1),
        other,
    ]
    replies = child.call("read_ack", [*bad, good])
    assert replies[:5] == ["ForgedHandleError"] * 4 + ["UnknownSegmentError"]
    assert replies[5] == expected(image_payload(2))
    writer.reclaim()
    assert writer.stats().used == 0
    assert child.call("read_ack", [good]) == ["StaleHandleError"]  # space was reused


def test_full_store_recovers_once_the_child_acks(pair) -> None:
    writer, child = pair
    big = {"b": np.ones(600_000, dtype=np.uint8)}
    first = writer.put(big)
    with pytest.raises(ShmStoreFullError):
        writer.put(big)
    assert child.call("ack", [first]) == [True]
    second = writer.put(big)  # the put itself scans the ack words and reclaims
    assert writer.stats().reclaimed_handles == 1
    assert child.call("read_ack", [second]) == [expected(big)]
