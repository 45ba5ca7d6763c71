"""The multimodal cache mirror: P1's receiver cache and P0's shadow of it, one policy.

P1 keeps the processed tensors of recent images in a :class:`ReceiverCache`; P0 keeps a
metadata-only :class:`SenderCache` (the *shadow*) and sends an item without data (a *shadow
hit*, ``data=None``) when it believes P1 still holds it. Both sides are the same
:class:`ByteBudgetLRU` with the same byte budget, and both charge an item
:func:`item_nbytes` of the same processor output.

The mirror invariant, for N shadows (P0 processes, client indexes 0..N-1, one P1; N = 1 is
the special case where every shadow is exact):

- **What a shadow may believe.** Let R be the keys P1's receiver holds. Shadow *i* holds
  (a) the items its own requests recorded (:meth:`SenderCache.record_request`, at render
  time: per request, first touch every item that is cached, then store the items sent with
  data in request order; an item larger than the budget is stored by neither side and is
  sent with its data every time), and (b) the items P1 reports that *other* clients'
  requests stored (:class:`~mmis.protocol.messages.CachedItem`, learned by
  :meth:`SenderCache.learn`; P1 never reports a client's own stores back to it), minus
  every hash P1 reports evicted. Lookups (``is_cached``, ``lookup``, ``peek``) never change
  the order. With one P0 (b) is empty and the shadow is R in the same LRU order. With N,
  each shadow's order is its own (other P0s' touches are not reported), so its own budget
  may drop items P1 still holds: a shadow may know *less* than R, which costs one resend of
  the data (P1 replaces the entry), never an error. So an item stored once is a shadow hit
  in every P0 and crosses to P1 once per pod, until P1 evicts it.
- **When it may be wrong** (believe an item P1 does not hold): between an eviction made by
  storing and the moment its report reaches the shadow (it rides on that client's next
  batch, at the latest the answer to its next ``hello`` heartbeat, and is applied by the
  next render before its first lookup); after the fault hooks
  :meth:`ReceiverCache.evict`/:meth:`~ReceiverCache.evict_random` dropped entries
  silently (drift on purpose); when a shared-memory descriptor went stale; after a P1
  restart (a new :attr:`ReceiverCache.epoch`) until the first batch that shows it; for an
  item one of its own requests recorded but P1 did not store (a smaller P1 budget, or the
  request never arrived). Its pending record is applied in P1's order per hash: the last
  event P1 reports for a hash wins (``engine/output_channel.py`` keeps one per hash).
- **How drift heals.** P1 never guesses: :meth:`ReceiverCache.resolve` ingests every item
  it can, then raises ONE typed, retryable
  :class:`~mmis.protocol.errors.MultiModalCacheMissError` naming every missing hash. P0
  queues those hashes as a batch (:mod:`mmis.frontend.client.pending_invalidations`),
  applies them on its render worker, and retries the request ONCE with every item carrying
  its data (:mod:`mmis.frontend.client.recovery`); a miss on the retry is a 503, never a
  crash. That chain is the only healing path; reported evictions, learned stores, a new
  epoch and a ``shadow_reset`` only make drift rarer, through the same pending set.
- **Restarts and bounds.** A restarted P0 starts with an empty shadow (it believes nothing,
  so it cannot be wrong) and asks P1 once for what it holds (``mm_cache_sync``: the
  newest entries, with a reset). A P1 restart empties every shadow through its new epoch.
  P1 keeps at most ``MAX_BACKLOG`` unheard hashes per client and forgets a client silent
  for ``CLIENT_TTL_S``; past either, that client gets one ``shadow_reset`` instead (forget
  everything), so a slow or gone P0 never grows P1's memory. P0's pending set holds
  evictions only of hashes its shadow holds and at most ``MAX_PENDING_STORES`` learned
  items (the oldest dropped first: forgetting is always safe).

Threads: the shadow is mutated only on P0's multimodal render worker (``is_cached`` is a
single dict membership test, safe to call from the asyncio output handler); the receiver is
touched only by P1's input thread. Neither has a lock.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Generic, Protocol, TypeVar

import numpy as np

from mmis.protocol.errors import MMISError, MultiModalCacheMissError, ProtocolError
from mmis.protocol.messages import CachedItem, ErrorCode, MultiModalFeature, ShmAddress
from mmis.shm.errors import ShmHandleError, StaleHandleError

# -- sizing: both sides charge an item the same bytes --------------------------------
# The size depends only on the tensors' dtypes and shapes, never on their values, the dict's
# key order or where the tensors live (numpy or torch, anything exposing ``nbytes``); a value
# that is not a tensor raises ItemSizeError instead of being guessed at.

TENSOR_OVERHEAD_BYTES: Final = 64
"""Fixed charge per tensor (header, bookkeeping): makes empty tensors cost something."""


class ItemSizeError(MMISError, TypeError):
    """An item whose tensors cannot be sized (a value without an integer ``nbytes``)."""

    code = ErrorCode.INVALID_REQUEST.value


def tensor_nbytes(name: str, tensor: Any) -> int:
    """Bytes charged for one tensor: its ``nbytes`` plus the fixed overhead."""
    nbytes = getattr(tensor, "nbytes", None)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ItemSizeError(
            f"multimodal tensor {name!r} has type {type(tensor).__name__}, which does not "
            "expose a non-negative integer nbytes; items must map names to arrays"
        )
    return nbytes + TENSOR_OVERHEAD_BYTES


def item_nbytes(tensors: Mapping[str, Any]) -> int:
    """Bytes charged for one item: the sum of :func:`tensor_nbytes` over its tensors."""
    if not isinstance(tensors, Mapping):
        raise ItemSizeError(
            f"a multimodal item must be a mapping of tensor name to array, "
            f"got {type(tensors).__name__}"
        )
    return sum(tensor_nbytes(str(name), tensor) for name, tensor in tensors.items())


# -- the byte-budget LRU: the one eviction policy of both sides ----------------------

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteBudgetLRU(Generic[K, V]):
    """Least-recently-used map whose entries each carry a byte size.

    - O(1) amortised (an ``OrderedDict``, oldest first), except that :meth:`put` evicts as
      many entries as it must; ``total_bytes`` is the sum of the stored sizes and never
      exceeds ``capacity_bytes``.
    - :meth:`peek`, :meth:`contains` and ``in`` never change the order; :meth:`touch` and
      :meth:`get` make an entry the newest; :meth:`put` stores it as the newest, replacing
      an entry under the same key, and never stores an entry larger than the budget.
    - Evicted keys are returned oldest first, so two LRUs fed the same operations evict the
      same keys in the same order. Not thread-safe: each owner serialises its calls.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._total = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recently used."""
        return iter(list(self._entries))

    def contains(self, key: K) -> bool:
        """Whether ``key`` is stored; does not change the order."""
        return key in self._entries

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` may be stored at all."""
        return 0 <= nbytes <= self._capacity

    def peek(self, key: K) -> V | None:
        """The value under ``key`` (or ``None``); does not change the order."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def size_of(self, key: K) -> int | None:
        """The byte size recorded for ``key`` (or ``None``); does not change the order."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def touch(self, key: K) -> bool:
        """Make ``key`` the most recently used; ``False`` if it is not stored."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def get(self, key: K) -> V | None:
        """The value under ``key`` (or ``None``), made the most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, nbytes: int) -> list[K]:
        """Store ``value`` as the newest entry; return the keys evicted to make room.

        An existing entry under ``key`` is replaced. An entry that can never fit is not
        stored, and a stale entry under its key is dropped (and reported as evicted).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        old = self._entries.pop(key, None)
        if old is not None:
            self._total -= old[1]
        if nbytes > self._capacity:
            return [key] if old is not None else []
        evicted: list[K] = []
        while self._total + nbytes > self._capacity:
            victim, (_, victim_bytes) = self._entries.popitem(last=False)
            self._total -= victim_bytes
            evicted.append(victim)
        self._entries[key] = (value, nbytes)
        self._total += nbytes
        return evicted

    def pop(self, key: K) -> V | None:
        """Remove ``key``; return its value, or ``None`` if it was not stored."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._total -= entry[1]
        return entry[0]

    def clear(self) -> list[K]:
        """Remove every entry; return the removed keys, oldest first."""
        keys = list(self._entries)
        self._entries.clear()
        self._total = 0
        return keys


# -- P0: the shadow ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShadowEntry:
    """What P0 remembers about an item P1 holds: enough to skip the processor's pixel work."""

    nbytes: int
    placeholder_length: int
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ShadowItem:
    """One item of a request as recorded after rendering it."""

    mm_hash: str
    entry: ShadowEntry


@dataclasses.dataclass(frozen=True)
class SenderCacheStats:
    hits: int
    misses: int
    recorded: int
    oversize: int
    evictions: int
    invalidations: int
    clears: int
    entries: int
    total_bytes: int
    capacity_bytes: int
    learned: int = 0


class SenderCache:
    """The metadata-only shadow of the receiver cache, on P0's render worker.

    Stores no tensors: ``mm_hash -> ShadowEntry`` (the item's :func:`item_nbytes` and its
    placeholder information). :meth:`lookup` counts hits and misses without changing the
    order; :meth:`record_request` then applies the request the way :meth:`ReceiverCache.resolve`
    will. A clear on a change of P1's cache epoch is requested through
    :class:`~mmis.frontend.client.pending_invalidations.PendingInvalidations`, which applies it on
    the render worker like any other invalidation.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._lru: ByteBudgetLRU[str, ShadowEntry] = ByteBudgetLRU(capacity_bytes)
        self.hits = 0
        self.misses = 0
        self.recorded = 0
        self.oversize = 0
        self.evictions = 0
        self.invalidations = 0
        self.clears = 0
        self.learned = 0

    @property
    def capacity_bytes(self) -> int:
        return self._lru.capacity_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[str]:
        """Cached hashes, least recently used first."""
        return list(self._lru)

    def is_cached(self, mm_hash: str) -> bool:
        """Whether the shadow believes P1 holds ``mm_hash``. No order change, no counters."""
        return mm_hash in self._lru

    def get(self, mm_hash: str) -> ShadowEntry | None:
        """The entry for ``mm_hash``, without changing the order or counting."""
        return self._lru.peek(mm_hash)

    def lookup(self, mm_hashes: Sequence[str]) -> list[ShadowEntry | None]:
        """Entries for a request's items (``None`` = send the data), counting hits/misses.

        Does not change the LRU order: :meth:`record_request` does that for the whole
        request, the way P1 will.
        """
        entries = [self._lru.peek(h) for h in mm_hashes]
        hits = sum(entry is not None for entry in entries)
        self.hits += hits
        self.misses += len(entries) - hits
        return entries

    def record_request(self, items: Sequence[ShadowItem]) -> list[str]:
        """Apply one request: touch every cached item, then record the others in order.

        Returns the hashes evicted to make room. Items larger than the budget are skipped.
        """
        fresh: list[ShadowItem] = []
        for item in items:
            if not self._lru.touch(item.mm_hash):
                fresh.append(item)
        evicted: list[str] = []
        for item in fresh:
            if not self._lru.fits(item.entry.nbytes):
                self.oversize += 1
                continue
            evicted.extend(self._lru.put(item.mm_hash, item.entry, item.entry.nbytes))
            self.recorded += 1
        self.evictions += len(evicted)
        return evicted

    def learn(self, items: Iterable[CachedItem]) -> list[str]:
        """Believe what P1 reports another client's requests stored, oldest first.

        An item the shadow already holds is left where it is (no touch: its order is this
        shadow's own); one larger than the budget is skipped. Returns the hashes evicted to
        make room (the shadow forgets them; P1 may still hold them).
        """
        evicted: list[str] = []
        for item in items:
            if item.mm_hash in self._lru or not self._lru.fits(item.nbytes):
                continue
            entry = ShadowEntry(item.nbytes, item.placeholder_length)
            evicted.extend(self._lru.put(item.mm_hash, entry, item.nbytes))
            self.learned += 1
        self.evictions += len(evicted)
        return evicted

    def invalidate(self, mm_hash: str) -> bool:
        """Forget ``mm_hash`` (P1 reported it missing or evicted); ``True`` if it was cached."""
        if self._lru.pop(mm_hash) is None:
            return False
        self.invalidations += 1
        return True

    def invalidate_many(self, mm_hashes: Iterable[str]) -> int:
        """Forget every hash in ``mm_hashes``; return how many were cached."""
        return sum(self.invalidate(h) for h in mm_hashes)

    def clear(self) -> None:
        """Forget everything (P1 restarted, or the cache was reset)."""
        self._lru.clear()
        self.clears += 1

    def stats(self) -> SenderCacheStats:
        return SenderCacheStats(
            hits=self.hits,
            misses=self.misses,
            recorded=self.recorded,
            oversize=self.oversize,
            evictions=self.evictions,
            invalidations=self.invalidations,
            clears=self.clears,
            entries=len(self._lru),
            total_bytes=self._lru.total_bytes,
            capacity_bytes=self._lru.capacity_bytes,
            learned=self.learned,
        )


# -- P1: the receiver ----------------------------------------------------------------


Tensors = dict[str, Any]
ShmReader = Callable[[ShmAddress], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class ReceiverCacheStats:
    hits: int
    misses: int
    stored: int
    oversize: int
    evictions: int
    fault_evictions: int
    entries: int
    total_bytes: int
    capacity_bytes: int


class CacheListener(Protocol):
    """Told what a :class:`ReceiverCache` holds as it changes (``engine/mm_events.py``)."""

    def stored(self, mm_hash: str, nbytes: int) -> None: ...

    def evicted(self, mm_hashes: Sequence[str]) -> None: ...

    def cleared(self, epoch: str) -> None: ...


class ReceiverCache:
    """The tensors P0's shadow believes P1 holds. Only P1's input thread touches it.

    :meth:`resolve` handles a request in three steps: (1) touch every feature's key that is
    stored and capture its tensors right then, (2) store every feature that carries data (a
    dict of tensors, or an ``ShmAddress`` resolved by the injected ``shm_reader``, which
    copies the payload out and acknowledges the descriptor), in request order, a resent
    payload replacing the entry, (3) raise ONE :class:`MultiModalCacheMissError` naming every
    ``data=None`` feature, and every feature whose descriptor turned out stale, that was
    neither stored at (1) nor carried by a sibling. The good items are ingested before the
    error is raised, so the retry only needs to carry the missing ones. A forged or unknown
    descriptor fails the request with its :class:`~mmis.shm.errors.ShmHandleError`, raised
    only after every other descriptor was read and acknowledged (the writer's space is
    reclaimed). Evictions made by storing are kept until :meth:`drain_evicted`, stores
    (what other P0s' shadows learn) until :meth:`drain_stored`; both only ever name
    hashes stored at least once, so they are bounded by the entries the budget holds plus
    the evictions since the last drain (P1's input thread drains both after each message).
    """

    def __init__(self, capacity_bytes: int, shm_reader: ShmReader | None = None) -> None:
        self._lru: ByteBudgetLRU[str, Tensors] = ByteBudgetLRU(capacity_bytes)
        self._shm_reader = shm_reader
        self._evicted: list[str] = []
        self._stored: dict[str, CachedItem] = {}  # stored since the last drain, still held
        self._lengths: dict[str, int] = {}  # placeholder length of every held entry
        self.epoch = uuid.uuid4().hex  # changes on every P1 start
        # told every store, eviction (silent ones too) and clear: engine/mm_events.py
        self.listener: CacheListener | None = None
        self.hits = 0
        self.misses = 0
        self.stored = 0
        self.oversize = 0
        self.evictions = 0
        self.fault_evictions = 0

    @property
    def capacity_bytes(self) -> int:
        return self._lru.capacity_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._lru

    def keys(self) -> list[str]:
        """Stored hashes, least recently used first."""
        return list(self._lru)

    def peek(self, mm_hash: str) -> Tensors | None:
        """The stored tensors for ``mm_hash``, without changing the order."""
        return self._lru.peek(mm_hash)

    def resolve(self, features: Sequence[MultiModalFeature]) -> list[Tensors]:
        """The tensors of every feature, in order; raises one error for all missing ones."""
        resolved: list[Tensors | None] = [None] * len(features)
        for i, feature in enumerate(features):
            if self._lru.touch(feature.mm_hash):
                resolved[i] = self._lru.peek(feature.mm_hash)
        provided: dict[str, Tensors] = {}
        unread: set[int] = set()  # data=None, or a descriptor whose space was reclaimed
        failure: ShmHandleError | None = None
        for i, feature in enumerate(features):
            if feature.data is None:
                unread.add(i)
                continue
            try:
                tensors = self._read(feature)
            except StaleHandleError:
                unread.add(i)
                continue
            except ShmHandleError as exc:  # forged or unknown: fail, after reading the rest
                failure = failure or exc
                continue
            self._store(feature.mm_hash, tensors, feature.placeholder.length)
            provided[feature.mm_hash] = tensors
            resolved[i] = tensors
        if failure is not None:
            raise failure
        missing: list[str] = []
        for i in sorted(unread):
            key = features[i].mm_hash
            if resolved[i] is None:
                resolved[i] = provided.get(key)
            if resolved[i] is None:
                missing.append(key)
                self.misses += 1
            else:
                self.hits += 1
        if missing:
            raise MultiModalCacheMissError(missing)
        return [tensors for tensors in resolved if tensors is not None]

    def _read(self, feature: MultiModalFeature) -> Tensors:
        data = feature.data
        if isinstance(data, ShmAddress):
            if self._shm_reader is None:
                raise ProtocolError(
                    f"item {feature.mm_hash!r} arrived as a shared-memory address, but this "
                    "engine has no shared-memory reader (cache type is not 'shm')"
                )
            return self._shm_reader(data)
        if not isinstance(data, Mapping):
            raise ProtocolError(
                f"item {feature.mm_hash!r} carries data of type {type(data).__name__}; "
                "expected a mapping of tensor name to array, an address or None"
            )
        return dict(data)

    def _store(self, mm_hash: str, tensors: Tensors, placeholder_length: int) -> None:
        nbytes = item_nbytes(tensors)
        fits = self._lru.fits(nbytes)
        if fits:
            self.stored += 1
        else:
            self.oversize += 1  # used for this request only; put() drops any stale entry
        self._note_evicted(self._lru.put(mm_hash, tensors, nbytes))
        if fits:
            self._lengths[mm_hash] = placeholder_length
            self._stored.pop(mm_hash, None)  # the newest store last
            self._stored[mm_hash] = CachedItem(mm_hash, nbytes, placeholder_length)
            if self.listener is not None:
                self.listener.stored(mm_hash, nbytes)

    def _note_evicted(self, hashes: list[str]) -> None:
        self.evictions += len(hashes)
        self._evicted.extend(hashes)
        for mm_hash in hashes:
            self._stored.pop(mm_hash, None)
            self._lengths.pop(mm_hash, None)
        if hashes and self.listener is not None:
            self.listener.evicted(hashes)

    def drain_stored(self) -> list[CachedItem]:
        """Items stored since the last drain that are still held, oldest store first."""
        stored, self._stored = self._stored, {}
        return [item for item in stored.values() if item.mm_hash in self._lru]

    def snapshot(self, limit: int) -> list[CachedItem]:
        """What the cache holds now, least recently used first: its newest ``limit`` entries
        as a fresh shadow needs them (the placeholder lengths P1 learned when storing)."""
        keys = list(self._lru)[-limit:] if limit > 0 else []
        lengths = self._lengths
        return [CachedItem(h, self._lru.size_of(h) or 0, lengths[h]) for h in keys if h in lengths]

    def drain_evicted(self) -> list[str]:
        """Hashes evicted since the last drain that are still absent, oldest first."""
        evicted, self._evicted = self._evicted, []
        return [h for h in dict.fromkeys(evicted) if h not in self._lru]

    def evict(self, mm_hashes: Iterable[str], *, silent: bool = True) -> list[str]:
        """Drop ``mm_hashes`` on purpose; return those that were stored.

        Silent by default (the point of the fault knob is drift P0 does not know about);
        ``silent=False`` also queues them for :meth:`drain_evicted`.
        """
        dropped = [h for h in dict.fromkeys(mm_hashes) if self._lru.pop(h) is not None]
        for mm_hash in dropped:
            self._stored.pop(mm_hash, None)
            self._lengths.pop(mm_hash, None)
        self.fault_evictions += len(dropped)
        if dropped and self.listener is not None:  # silent to P0, never to routers
            self.listener.evicted(dropped)
        if not silent:
            self._evicted.extend(dropped)
        return dropped

    def evict_random(self, rate: float, rng: random.Random, *, silent: bool = True) -> list[str]:
        """Drop each stored entry with probability ``rate`` (0..1); return the dropped."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"eviction rate must be within [0, 1], got {rate}")
        victims = [h for h in self._lru if rng.random() < rate]
        return self.evict(victims, silent=silent)

    def clear(self) -> None:
        """Drop everything without reporting (a restart gets a new epoch instead)."""
        self._lru.clear()
        self._stored.clear()
        self._lengths.clear()
        self._evicted.clear()
        self.epoch = uuid.uuid4().hex
        if self.listener is not None:
            self.listener.cleared(self.epoch)

    def stats(self) -> ReceiverCacheStats:
        return ReceiverCacheStats(
            hits=self.hits,
            misses=self.misses,
            stored=self.stored,
            oversize=self.oversize,
            evictions=self.evictions,
            fault_evictions=self.fault_evictions,
            entries=len(self._lru),
            total_bytes=self._lru.total_bytes,
            capacity_bytes=self._lru.capacity_bytes,
        )
