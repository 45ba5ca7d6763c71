"""The receiver cache's changes as mmis's multimodal events, for routers (docs/ROUTING.md;
wire format in ``protocol/kv_events.py``, sockets in ``engine/event_publisher.py``).

``ReceiverCache`` (``multimodal/cache.py``) tells its :class:`MMEventLog` listener about
every item it stores, every eviction (the fault knob's silent ones included: P0 is not told
of those, a router must be) and every clear. The engine process
(``engine/core_process.py``) flushes the stream after each admitted request and each
utility call, on its input thread: the only thread that touches the receiver cache.

Invariants:
- A stream opens with ``EpochStarted(epoch)``, and a clear (a new epoch) restarts it the
  same way. A router drops the pod's items whenever it sees one.
- With no listener (the default) the cache does no event work.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmis.engine.event_publisher import EventPublisher, EventStream
from mmis.protocol.kv_events import EpochStarted, MMItemEvicted, MMItemStored

Event = EpochStarted | MMItemStored | MMItemEvicted


class MMEventLog:
    """Pending receiver-cache events since the last :meth:`drain` (a ``CacheListener``)."""

    def __init__(self) -> None:
        self._events: list[Event] = []

    def stored(self, mm_hash: str, nbytes: int) -> None:
        self._events.append(MMItemStored(mm_hash=mm_hash, nbytes=nbytes))

    def evicted(self, mm_hashes: Sequence[str]) -> None:
        self._events.extend(MMItemEvicted(mm_hash=h) for h in mm_hashes)

    def cleared(self, epoch: str) -> None:
        self._events = [EpochStarted(epoch=epoch)]

    def drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events


class MMEventStream(EventStream):
    """The multimodal stream: opens with ``EpochStarted(epoch)``."""

    log: MMEventLog

    def __init__(self, log: MMEventLog, publisher: EventPublisher, epoch: str) -> None:
        super().__init__(log, publisher, [EpochStarted(epoch=epoch)])
