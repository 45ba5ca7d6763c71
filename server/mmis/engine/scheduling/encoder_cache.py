"""The encoder cache manager: which vision-encoder outputs the model runner holds, by mm_hash.

The budget is counted in token slots (one slot per embedding, i.e. per placeholder token).

Invariants:
- An entry is *referenced* while some request still needs its embeddings; it is *freeable*
  when no request references it. Freeable entries keep their slots (their output may be
  reused by a later request) and are evicted lazily, least-recently-freed first, only when an
  allocation needs the space.
- ``num_free_slots + sum(sizes of all entries) == num_slots`` at all times.
- Evicted hashes are reported to the runner once per scheduling pass (:meth:`take_freed`),
  filtered by the final state of the pass: a hash evicted and allocated again in the same pass
  is *not* reported (the runner still holds its tensor and the new allocation relies on it being
  recomputed or kept), and an allocation cancelled before the runner ever saw it is reported
  only if the runner still holds an older output for that hash.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheError(RuntimeError):
    """Bookkeeping misuse (a scheduler bug): allocating without room, cancelling shared entries."""


class EncoderCacheManager:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"encoder cache size must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.num_free_slots = num_slots
        self._sizes: dict[str, int] = {}
        self._refs: dict[str, set[str]] = {}  # mm_hash -> request ids
        self._req_refs: dict[str, set[str]] = {}  # request id -> mm_hashes
        self._freeable: OrderedDict[str, int] = OrderedDict()  # LRU: first = evicted first
        self._freed: list[str] = []
        self.num_evictions = 0

    # -- queries -----------------------------------------------------------------------------

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._sizes

    @property
    def num_freeable_slots(self) -> int:
        """Slots that could be made free now: free ones plus unreferenced entries."""
        return self.num_free_slots + sum(self._freeable.values())

    def refs(self, mm_hash: str) -> frozenset[str]:
        return frozenset(self._refs.get(mm_hash, ()))

    def usage(self) -> float:
        return 1.0 - self.num_free_slots / self.num_slots

    # -- references --------------------------------------------------------------------------

    def acquire(self, request_id: str, mm_hash: str) -> bool:
        """If ``mm_hash`` is cached, make ``request_id`` reference it and return True."""
        if mm_hash not in self._sizes:
            return False
        self._refs[mm_hash].add(request_id)
        self._req_refs.setdefault(request_id, set()).add(mm_hash)
        self._freeable.pop(mm_hash, None)
        return True

    def release(self, request_id: str, mm_hash: str) -> None:
        """``request_id`` no longer needs ``mm_hash``; unreferenced entries become freeable."""
        refs = self._refs.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        req_refs = self._req_refs.get(request_id)
        if req_refs is not None:
            req_refs.discard(mm_hash)
            if not req_refs:
                del self._req_refs[request_id]
        if not refs:
            self._freeable[mm_hash] = self._sizes[mm_hash]

    def release_all(self, request_id: str) -> None:
        for mm_hash in list(self._req_refs.get(request_id, ())):
            self.release(request_id, mm_hash)

    # -- allocation --------------------------------------------------------------------------

    def can_allocate(self, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` slots, evicting freeable entries (LRU) only if needed.

        Evicts nothing when the room cannot be made.
        """
        if num_tokens <= self.num_free_slots:
            return True
        if num_tokens > self.num_freeable_slots:
            return False
        while num_tokens > self.num_free_slots:
            mm_hash, _size = self._freeable.popitem(last=False)
            self._drop(mm_hash)
            self._freed.append(mm_hash)
            self.num_evictions += 1
        return True

    def allocate(self, request_id: str, mm_hash: str, num_tokens: int) -> None:
        """Reserve ``num_tokens`` slots for ``mm_hash`` (to be computed this step)."""
        if mm_hash in self._sizes:
            raise EncoderCacheError(f"{mm_hash!r} is already cached; acquire it instead")
        if num_tokens > self.num_free_slots:
            raise EncoderCacheError(
                f"{mm_hash!r} needs {num_tokens} slots, {self.num_free_slots} free; "
                "call can_allocate first"
            )
        self._sizes[mm_hash] = num_tokens
        self._refs[mm_hash] = {request_id}
        self._req_refs.setdefault(request_id, set()).add(mm_hash)
        self.num_free_slots -= num_tokens

    def cancel(self, request_id: str, mm_hash: str) -> None:
        """Undo an :meth:`allocate` of this pass whose encoder run will not be scheduled."""
        refs = self._refs.get(mm_hash)
        if refs is None:
            return
        if refs - {request_id}:
            raise EncoderCacheError(
                f"cannot cancel {mm_hash!r}: other requests rely on it being computed"
            )
        self._freeable.pop(mm_hash, None)
        self._drop(mm_hash)
        req_refs = self._req_refs.get(request_id)
        if req_refs is not None:
            req_refs.discard(mm_hash)
            if not req_refs:
                del self._req_refs[request_id]

    def _drop(self, mm_hash: str) -> None:
        self.num_free_slots += self._sizes.pop(mm_hash)
        del self._refs[mm_hash]

    # -- reporting ---------------------------------------------------------------------------

    def take_freed(self) -> list[str]:
        """The hashes evicted since the last call that are still absent: once per pass."""
        seen: set[str] = set()
        out = []
        for mm_hash in self._freed:
            if mm_hash not in self._sizes and mm_hash not in seen:
                seen.add(mm_hash)
                out.append(mm_hash)
        self._freed.clear()
        return out
