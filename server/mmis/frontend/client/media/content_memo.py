"""The content memo: an image's encoded bytes seen before are not decoded again.

A chat resends its image on every turn, and a popular picture arrives in many requests. For a
4-12 MP JPEG, P0 spends ~15 ms reading the data URL and ~40-60 ms decoding it to pixels
(benchmarks/README.md, "Several P0 processes per engine"); when the shadow then says P1 holds
the item, none of those pixels is ever used. The memo maps the digest of the bytes as
received (with the processor kwargs the hash covers) to the ``mm_hash`` computed the first
time, once those bytes decoded under this process's limits, so a repeat costs one pass of
BLAKE3 over the bytes (~2 ms), and the pixels are decoded only if a render needs them
(:class:`EncodedImage`).

Invariants:
- The ``mm_hash`` is the hash of the bytes with the decoder's identity
  (``multimodal/hashing.py`` ``encoded_item_mm_hash``): the memo only remembers it, and that
  the bytes decoded. Different bytes that decode to the same pixels (a PNG recompressed) are
  another item, with another hash.
- An entry is made only after the bytes decoded under this process's limits (format list,
  pixel cap), so a hit never skips a check a first sight would have failed.
- Bounded: :data:`MEMO_ENTRIES` keys of ~100 bytes each, least recently used dropped first.
  Only the event loop touches it (``Renderer.prepare``): no lock.
- Nothing in it leaves the process, and a key is never an ``mm_hash``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Final

import blake3
from PIL import Image

MEMO_ENTRIES: Final = 8192


def bytes_digest(data: bytes) -> bytes:
    """The BLAKE3 digest of the bytes as received (32 bytes)."""
    return blake3.blake3(data).digest()


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
    """``(bytes digest, hashing context) -> mm_hash``, bounded LRU (see the module)."""

    def __init__(self, entries: int = MEMO_ENTRIES) -> None:
        self.entries = entries
        self._map: collections.OrderedDict[tuple[bytes, str], str] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, digest: bytes, context: str) -> str | None:
        mm_hash = self._map.get((digest, context))
        if mm_hash is None:
            self.misses += 1
            return None
        self._map.move_to_end((digest, context))
        self.hits += 1
        return mm_hash

    def put(self, digest: bytes, context: str, mm_hash: str) -> None:
        self._map[(digest, context)] = mm_hash
        self._map.move_to_end((digest, context))
        while len(self._map) > self.entries:
            self._map.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)
