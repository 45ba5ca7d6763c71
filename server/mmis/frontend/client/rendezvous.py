"""Rendezvous (highest-random-weight) hashing: which encoder an item goes to.

Every P0 picks, for an item's ``mm_hash``, the node with the highest :func:`weight` of
``(node, mm_hash)`` among the live nodes (``frontend/client/encoder_pool.py``), so a repeated
image goes to the encoder that encoded it before, from any P0, without coordination.

Invariants:
- Deterministic across processes and runs: the weight is a BLAKE2b digest of the node name
  and the key, never Python's salted ``hash``.
- Minimal movement: removing a node moves only the keys that node owned (each to the node
  with the next-highest weight); adding one moves to it only the keys it now wins. The order
  of ``nodes`` never matters.
- Uniform: each of N nodes owns about 1/N of the keys (the weights are independent uniform
  64-bit values).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

_PERSON = b"mmis-hrw"


def weight(node: str, key: str) -> int:
    """The 64-bit weight of ``key`` on ``node``."""
    data = node.encode() + b"\0" + key.encode()  # a node name has no NUL: no ambiguity
    digest = hashlib.blake2b(data, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big")


def pick(key: str, nodes: Iterable[str]) -> str | None:
    """The node of ``nodes`` that owns ``key`` (None when there is none); ties, which need
    a 64-bit collision, go to the smaller node name."""
    best: tuple[int, str] | None = None
    for node in nodes:
        w = weight(node, key)
        if best is None or w > best[0] or (w == best[0] and node < best[1]):
            best = (w, node)
    return None if best is None else best[1]
