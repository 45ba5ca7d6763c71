"""S6 at unit level: miss reports racing renders on the single multimodal worker.

The renders run on a real ``ThreadPoolExecutor(max_workers=1)``; interleavings are forced
with ``threading.Event`` and joins bounded by a timeout only so a regression fails instead
of hanging. The test thread plays the asyncio output handler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.multimodal.cache import SenderCache, ShadowEntry, ShadowItem
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange

WAIT = 10.0  # upper bound for a forced step; never reached when the code is right


class ExpectedCachedItemError(AssertionError):
    """What a render hits if its cached item vanishes between lookup and merge."""


def _record(shadow: SenderCache, *hashes: str) -> None:
    shadow.record_request([ShadowItem(h, ShadowEntry(8, 1)) for h in hashes])


def render(
    shadow: SenderCache,
    pending: PendingInvalidations,
    h: str,
    in_window: Callable[[], None] = lambda: None,
) -> MultiModalFeature:
    """A render as the front end does it: drain, look up, (processor work), merge, record."""
    pending.drain()
    entry = shadow.lookup([h])[0]
    in_window()  # the processor runs between the lookup and the merge
    if entry is not None and shadow.get(h) is None:
        raise ExpectedCachedItemError(f"expected a cached item for {h}")
    data = None if entry is not None else {"pixel_values": np.zeros(8, np.uint8)}
    _record(shadow, h)
    return MultiModalFeature(
        modality="image", mm_hash=h, placeholder=PlaceholderRange(0, 1), data=data
    )


def _in_thread(fn: Callable[[], object]) -> list[object]:
    """Run ``fn`` on another thread; fail if it does not return within WAIT seconds."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), "the call blocked"
    return out


@pytest.fixture
def worker() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def test_queued_render_sees_invalidation_before_its_lookup(worker: ThreadPoolExecutor) -> None:
    shadow = SenderCache(1024)
    _record(shadow, "h", "g")
    pending = PendingInvalidations(shadow)
    a_in_window, release_a = threading.Event(), threading.Event()

    def hold() -> None:
        a_in_window.set()
        assert release_a.wait(WAIT)

    fut_a = worker.submit(render, shadow, pending, "h", hold)  # A: looked up h, now busy
    assert a_in_window.wait(WAIT)
    fut_b = worker.submit(render, shadow, pending, "h")  # B: queued behind A
    # P1 reports h missing: the output handler enqueues without waiting for the worker
    assert _in_thread(lambda: pending.enqueue(["h"])) == [1]
    assert not fut_a.done() and not fut_b.done()  # the worker really was busy throughout
    assert shadow.is_cached("h")  # A's view is undisturbed until a render boundary
    release_a.set()
    a, b = fut_a.result(WAIT), fut_b.result(WAIT)  # neither raises "expected a cached item"
    assert a.data is None  # A used its hit
    assert b.data is not None  # B drained first, so it treated h as not cached
    assert shadow.is_cached("h") and shadow.is_cached("g")
    assert len(pending) == 0


def test_invalidating_directly_from_output_thread_breaks_a_running_render(
    worker: ThreadPoolExecutor,
) -> None:
    """The harness has teeth: the naive design fails it with the reported assertion."""
    shadow = SenderCache(1024)
    _record(shadow, "h")
    pending = PendingInvalidations(shadow)
    in_window, release = threading.Event(), threading.Event()

    def hold() -> None:
        in_window.set()
        assert release.wait(WAIT)

    fut = worker.submit(render, shadow, pending, "h", hold)
    assert in_window.wait(WAIT)
    shadow.invalidate("h")  # naive: invalidate on the output handler thread
    release.set()
    with pytest.raises(ExpectedCachedItemError):
        fut.result(WAIT)


def test_enqueue_not_blocked_by_a_slow_invalidation(worker: ThreadPoolExecutor) -> None:
    entered, release = threading.Event(), threading.Event()

    class SlowShadow(SenderCache):
        def invalidate(self, mm_hash: str) -> bool:
            if mm_hash == "slow":
                entered.set()
                assert release.wait(WAIT)
            return super().invalidate(mm_hash)

    shadow = SlowShadow(1024)
    _record(shadow, "slow", "other")
    pending = PendingInvalidations(shadow)
    pending.enqueue(["slow"])
    fut = worker.submit(pending.drain)
    assert entered.wait(WAIT)
    assert _in_thread(lambda: pending.enqueue(["other"])) == [1]  # lock not held meanwhile
    release.set()
    assert fut.result(WAIT) == 1
    assert not shadow.is_cached("slow") and pending.pending() == ["other"]


def test_duplicates_coalesce() -> None:
    shadow = SenderCache(1024)
    _record(shadow, "h", "g")
    pending = PendingInvalidations(shadow)
    assert pending.enqueue(["h", "h", "g"]) == 2
    assert pending.enqueue(["h"]) == 0
    assert pending.pending() == ["h", "g"] and pending.coalesced == 1
    assert pending.drain() == 2
    assert len(shadow) == 0 and len(pending) == 0


def test_reports_for_uncached_hashes_are_dropped_and_set_stays_bounded() -> None:
    shadow = SenderCache(1024)
    _record(shadow, "c0", "c1", "c2")
    pending = PendingInvalidations(shadow)
    for i in range(1000):
        pending.enqueue([f"absent{i}", f"c{i % 3}"])
        assert len(pending) <= len(shadow)
    assert sorted(pending.pending()) == ["c0", "c1", "c2"]
    assert pending.dropped_uncached == 1000


def test_empty_and_fully_filtered_input_return_without_the_lock() -> None:
    shadow = SenderCache(1024)
    _record(shadow, "h")
    pending = PendingInvalidations(shadow)
    pending.enqueue(["h"])
    with pending._lock:  # another thread holds the lock (e.g. mid-swap)
        assert _in_thread(lambda: pending.enqueue([])) == [0]
        assert _in_thread(lambda: pending.enqueue(())) == [0]
        assert _in_thread(lambda: pending.enqueue(["absent"])) == [0]
    assert pending.pending() == ["h"]  # the existing record is untouched


def test_failing_invalidation_loses_no_pending_hash() -> None:
    pending: PendingInvalidations

    class FlakyShadow(SenderCache):
        fail = True

        def invalidate(self, mm_hash: str) -> bool:
            if mm_hash == "bad" and self.fail:
                self.fail = False
                # a new report arrives from the output thread while this drain runs
                _in_thread(lambda: pending.enqueue(["late", "c"]))
                raise OSError("invalidation failed")
            return super().invalidate(mm_hash)

    shadow = FlakyShadow(1024)
    _record(shadow, "a", "bad", "c", "late")
    pending = PendingInvalidations(shadow)
    pending.enqueue(["a", "bad", "c"])
    with pytest.raises(OSError, match="invalidation failed"):
        pending.drain()
    assert not shadow.is_cached("a")  # processed before the failure
    assert pending.pending() == ["bad", "c", "late"]  # failed + unprocessed + new, no dupes
    assert pending.drain() == 3
    assert len(shadow) == 0 and len(pending) == 0


def test_epoch_change_clears_the_shadow_at_the_next_drain() -> None:
    shadow = SenderCache(1024)
    _record(shadow, "a", "b")
    pending = PendingInvalidations(shadow)
    assert pending.observe_epoch("e1") is False  # first sighting
    assert pending.observe_epoch("e1") is False
    pending.enqueue(["a"])
    assert pending.observe_epoch("e2") is True
    assert len(shadow) == 2  # nothing happens on the output thread
    pending.drain()
    assert len(shadow) == 0 and shadow.clears == 1 and not pending.clear_requested
    assert pending.drain() == 0 and shadow.clears == 1


def test_request_clear_supersedes_pending_and_survives_a_failing_clear() -> None:
    class FailingClear(SenderCache):
        fail = True

        def clear(self) -> None:
            if self.fail:
                self.fail = False
                raise OSError("clear failed")
            super().clear()

    shadow = FailingClear(1024)
    _record(shadow, "a", "b")
    pending = PendingInvalidations(shadow)
    pending.enqueue(["a"])
    pending.request_clear()
    assert len(pending) == 0 and pending.clear_requested
    with pytest.raises(OSError, match="clear failed"):
        pending.drain()
    assert pending.clear_requested  # not lost
    pending.drain()
    assert len(shadow) == 0 and not pending.clear_requested
