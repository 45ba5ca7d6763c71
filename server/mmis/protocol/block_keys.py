"""Prefix-cache block keys: the chained hash both sides compute (docs/ROUTING.md).

P1's prefix cache keys its blocks with them (``engine/scheduling/kv_cache.py``) and announces them
in its KV events. P0 computes the same keys for a request before it is sent
(``POST /internal/block_keys``), so a router can ask any replica what a request's blocks are
called and look them up in each replica's announcements.

The hash of full block ``i`` covers the parent hash (block ``i - 1``; none for block 0),
the block's token ids, and *extra keys*. There is one extra key for every multimodal item
whose placeholder range overlaps the block: the item's ``mm_hash`` and the
block's start relative to the item's offset, ordered by item offset. So the same
placeholder tokens with a different image, or the same image at another offset, never
share a block. A request under a LoRA adapter (``lora_id`` > 0, issue 47) chains from a
root of its own, :func:`lora_root`, in place of block 0's missing parent: every block of it
differs from the base model's and any other adapter's, and requests under one adapter share.
``lora_id`` 0 (the base model) gives the keys as before adapters existed.

Invariants: pure and deterministic across processes (msgpack of plain values, blake2b-256;
no seed); only msgspec and the standard library (``protocol`` is a leaf).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from mmis.protocol.messages import MultiModalFeature

BlockHash = bytes
_ENCODER = msgspec.msgpack.Encoder()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[tuple[str, int]]
) -> BlockHash:
    """The chained content hash of one full block."""
    payload = _ENCODER.encode((parent, list(token_ids), [list(k) for k in extra_keys]))
    return hashlib.blake2b(payload, digest_size=32).digest()


def lora_root(lora_id: int) -> BlockHash | None:
    """The parent of block 0 under adapter ``lora_id`` (None for the base model, 0). An id
    names one adapter for an engine's whole life (``engine/lora/manager.py`` never reuses
    one), so a block is never served under an adapter other than the one it was computed by."""
    if not lora_id:
        return None
    payload = _ENCODER.encode(("lora", int(lora_id)))
    return hashlib.blake2b(payload, digest_size=32).digest()


def block_extra_keys(
    features: Sequence[MultiModalFeature], start: int, end: int
) -> list[tuple[str, int]]:
    """(mm_hash, start - item offset) for each item overlapping tokens ``[start, end)``."""
    keys = []
    for feature in features:
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if offset < end and offset + length > start:
            keys.append((feature.mm_hash, start - offset))
    keys.sort(key=lambda k: -k[1])  # by item offset, so the order is canonical
    return keys


def chain(
    token_ids: Sequence[int],
    features: Sequence[MultiModalFeature],
    block_size: int,
    hashes: list[BlockHash] | None = None,
    lora_id: int = 0,
) -> list[BlockHash]:
    """Extend ``hashes`` (in place; a new list when None) to every full block of
    ``token_ids`` and return it (under adapter ``lora_id``; 0: the base model)."""
    hashes = [] if hashes is None else hashes
    num_full = len(token_ids) // block_size
    while len(hashes) < num_full:
        i = len(hashes)
        start, end = i * block_size, (i + 1) * block_size
        parent = hashes[-1] if hashes else lora_root(lora_id)
        extra = block_extra_keys(features, start, end) if features else []
        hashes.append(hash_block(parent, token_ids[start:end], extra))
    return hashes
