"""The content memo: an image's encoded bytes seen before are not decoded again.

A chat resends its image on every turn, and a popular picture arrives in many requests. For a
4-12 MP JPEG, P0 spends ~15 ms reading the data URL and ~40-60 ms decoding it to pixels
(benchmarks/README.md, "Several P0 processes per engine"); when the shadow then says P1 holds
the item, none of those pixels is ever used. An image's ``mm_hash`` is the hash of its bytes as
received (``multimodal/hashing.py`` ``encoded_item_mm_hash``, with the decoder's identity, the
model and the processor kwargs), computed without decoding; the memo remembers which hashes'
bytes decoded under this process's limits, so a repeat costs the one hash pass every image
pays (~2 ms) and its pixels are decoded only if a render needs them (:class:`EncodedImage`).
Bytes never seen are hashed once, not twice: the hash is the memo's key.

Invariants:
- Only the ``mm_hash`` is remembered, and that its bytes decoded. Different bytes that decode
  to the same pixels (a PNG recompressed) are another item, with another hash; the hash
  algorithms are cryptographic (``HASH_ALGORITHMS``), so other bytes cannot claim a
  remembered hash and skip the decode.
- An entry is made only after the bytes decoded under this process's limits (format list,
  pixel cap), so a hit never skips a check a first sight would have failed.
- Bounded: :data:`MEMO_ENTRIES` hashes of ~64 bytes each, least recently used dropped first.
  Only the event loop touches it (``Renderer.prepare``): no lock.
- Nothing in it leaves the process.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Final

from PIL import Image

MEMO_ENTRIES: Final = 8192


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedImage:
    """An image whose ``mm_hash`` came from the memo: its bytes, decoded only when a render
    needs the pixels (a shadow miss, a retry with data, an unknown placeholder length);
    decoded at most once."""

    data: bytes
    decoder: Callable[[bytes], Image.Image]

    @functools.cached_property
    def image(self) -> Image.Image:
        return self.decoder(self.data)


class ContentMemo:
    """The ``mm_hash``es whose bytes decoded here, a bounded LRU set (see the module)."""

    def __init__(self, entries: int = MEMO_ENTRIES) -> None:
        self.entries = entries
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def knows(self, mm_hash: str) -> bool:
        """Whether ``mm_hash``'s bytes decoded here before (a hit counts and refreshes it)."""
        if mm_hash not in self._seen:
            self.misses += 1
            return False
        self._seen.move_to_end(mm_hash)
        self.hits += 1
        return True

    def remember(self, mm_hash: str) -> None:
        """Record that ``mm_hash``'s bytes decoded under this process's limits."""
        self._seen[mm_hash] = None
        self._seen.move_to_end(mm_hash)
        while len(self._seen) > self.entries:
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)
