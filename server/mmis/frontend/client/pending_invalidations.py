"""Updates of P0's shadow, handed from the output handler to the render worker.

P1 reports missing (and evicted) hashes on its outputs, which P0 reads on the asyncio output
handler thread. Invalidating the shadow right there would race a render running on the
single multimodal worker between its cache lookup and its merge ("expected a cached item").
So the output handler only *enqueues* the hashes here, before it publishes the outputs, and
every render *drains* them on the worker before its first cache lookup.

Invariants:
- :meth:`PendingInvalidations.enqueue` never waits for the worker or for an invalidation in
  progress: it returns at once for empty input, checks membership outside the lock, keeps
  only hashes the shadow currently holds and coalesces duplicates. The lock only guards
  set updates and swaps.
- :meth:`PendingInvalidations.drain` swaps the pending set out under the lock and
  invalidates outside it. If an invalidation raises, the failed hash and every one not yet
  processed go back into the pending set (merged with hashes that arrived meanwhile, none
  lost) and the exception propagates to the render.
- The pending set holds at most one record per hash that was in the shadow when it was
  reported; records for hashes evicted since then are harmless no-ops at the next drain.
- A change of P1's cache epoch (P1 restarted), or P1's ``shadow_reset``, requests a full
  clear, applied by the next drain; it supersedes the hashes and learned items pending at
  that moment.
- Items other P0s stored (P1's ``stored_mm_items``, the N-shadow invariant of
  ``multimodal/cache.py``) are *learned* the same way: :meth:`PendingInvalidations.learn`
  queues them, the drain applies them after the clear and the invalidations, oldest first.
  A hash reported missing or evicted after it was queued to be learned is no longer
  learned (the last report wins). At most :data:`MAX_PENDING_STORES` wait (the oldest are
  dropped: a shadow that believes less only resends data), so an idle P0, which renders
  nothing, never grows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Final, Protocol

from mmis.protocol.messages import CachedItem

MAX_PENDING_STORES: Final = 4096
"""Learned items kept for the next drain; the oldest are dropped past it."""


class InvalidationTarget(Protocol):
    """The part of ``SenderCache`` this module drives."""

    def is_cached(self, mm_hash: str) -> bool: ...

    def invalidate(self, mm_hash: str) -> bool: ...

    def clear(self) -> None: ...

    def learn(self, items: Iterable[CachedItem]) -> list[str]: ...


class PendingInvalidations:
    """A small lock-protected set of hashes to drop from the shadow at the next render, and
    of items other P0s stored to add to it."""

    def __init__(self, cache: InvalidationTarget) -> None:
        self._cache = cache
        self._lock = threading.Lock()
        self._pending: dict[str, None] = {}  # an insertion-ordered set
        self._learned: OrderedDict[str, CachedItem] = OrderedDict()
        self._clear_requested = False
        self._epoch: str | None = None
        self.enqueued = 0
        self.dropped_uncached = 0
        self.coalesced = 0
        self.learned_dropped = 0  # learned items dropped past MAX_PENDING_STORES

    def __len__(self) -> int:
        return len(self._pending)

    def pending(self) -> list[str]:
        """A snapshot of the pending hashes, oldest first."""
        with self._lock:
            return list(self._pending)

    @property
    def clear_requested(self) -> bool:
        return self._clear_requested

    def enqueue(self, mm_hashes: Collection[str]) -> int:
        """Queue ``mm_hashes`` for invalidation; return how many new records were added.

        Called on the output handler thread, before the outputs naming them are published.
        """
        if not mm_hashes:
            return 0
        if self._learned:  # a later report wins over an item waiting to be learned
            with self._lock:
                for mm_hash in mm_hashes:
                    self._learned.pop(mm_hash, None)
        live = [h for h in dict.fromkeys(mm_hashes) if self._cache.is_cached(h)]
        self.dropped_uncached += len(set(mm_hashes)) - len(live)
        if not live:
            return 0
        with self._lock:
            before = len(self._pending)
            self._pending.update(dict.fromkeys(live))
            added = len(self._pending) - before
        self.enqueued += added
        self.coalesced += len(live) - added
        return added

    def learned(self) -> list[CachedItem]:
        """A snapshot of the items waiting to be learned, oldest first."""
        with self._lock:
            return list(self._learned.values())

    def learn(self, items: Collection[CachedItem]) -> int:
        """Queue items other P0s' requests stored (oldest first); return how many were queued.

        Called on the output handler thread, after the same batch's evictions. Items the
        shadow already holds are skipped (their place in the order is this shadow's own).
        """
        if not items:
            return 0
        fresh = [  # one whose eviction is pending is stored again: learn it after that
            item
            for item in items
            if item.mm_hash in self._pending or not self._cache.is_cached(item.mm_hash)
        ]
        if not fresh:
            return 0
        with self._lock:
            for item in fresh:
                self._learned.pop(item.mm_hash, None)
                self._learned[item.mm_hash] = item
            while len(self._learned) > MAX_PENDING_STORES:
                self._learned.popitem(last=False)
                self.learned_dropped += 1
        return len(fresh)

    def request_clear(self) -> None:
        """Ask the next drain to clear the whole shadow (P1 restarted or reset its cache).

        Supersedes the hashes pending now. Safe to call from the output handler thread.
        """
        with self._lock:
            self._clear_requested = True
            self._pending = {}
            self._learned = OrderedDict()

    def observe_epoch(self, epoch: str) -> bool:
        """Note P1's cache epoch; on a change, :meth:`request_clear` and return ``True``.

        For callers that see every epoch; a caller that already detects changes itself
        calls :meth:`request_clear` directly.
        """
        if not epoch:
            return False
        with self._lock:
            changed = self._epoch is not None and epoch != self._epoch
            self._epoch = epoch
        if changed:
            self.request_clear()
        return changed

    def drain(self) -> int:
        """Apply the pending invalidations; return how many hashes it processed.

        Called on the render worker at the start of every render, before its first lookup.
        """
        if not self._pending and not self._clear_requested and not self._learned:
            return 0  # the common case: no lock taken
        with self._lock:
            batch, self._pending = list(self._pending), {}
            clear, self._clear_requested = self._clear_requested, False
            learned, self._learned = self._learned, OrderedDict()
        if clear:
            try:
                self._cache.clear()
            except BaseException:
                with self._lock:
                    self._clear_requested = True
                    self._restore(batch)
                    self._restore_learned(learned)
                raise
        else:
            for index, mm_hash in enumerate(batch):
                try:
                    self._cache.invalidate(mm_hash)
                except BaseException:
                    with self._lock:
                        self._restore(batch[index:])
                        self._restore_learned(learned)
                    raise
        if learned:
            try:
                self._cache.learn(learned.values())
            except BaseException:
                with self._lock:
                    self._restore_learned(learned)
                raise
        return len(batch) + len(learned)

    def _restore_learned(self, items: OrderedDict[str, CachedItem]) -> None:
        """Put ``items`` back ahead of the ones that arrived meanwhile. Lock held."""
        merged = OrderedDict(items)
        merged.update(self._learned)
        self._learned = merged

    def _restore(self, hashes: list[str]) -> None:
        """Put ``hashes`` back ahead of the ones that arrived meanwhile. Lock held."""
        merged = dict.fromkeys(hashes)
        merged.update(self._pending)
        self._pending = merged
