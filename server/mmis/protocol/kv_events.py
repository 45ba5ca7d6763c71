"""Cache events an engine announces to routers: vLLM's KV-events wire format, plus mmis's
multimodal-cache events (docs/ROUTING.md).

KV events are byte-for-byte vLLM's (checked against vLLM 0.32's own encoder in
``tests/engine/test_kv_events.py``), so a subscriber built for vLLM reads them:

- a batch is a msgpack **array** ``[ts, events, data_parallel_rank]`` (the rank omitted when
  unset);
- each event is a msgpack **map** tagged ``"type"``: ``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``; fields left at their defaults are omitted;
- block hashes are the 32-byte digests (vLLM's default; it can also send 64-bit ints).

The multimodal events (:class:`MMEventBatch`) travel on a stream of their own
(``engine/event_publisher.py``): a vLLM subscriber never meets an event type it cannot
decode. ``EpochStarted`` opens that stream after every engine start, so a router drops what
it knew about the engine's previous life; the KV stream says the same with
``AllBlocksCleared``.

Invariants: only msgspec here (``protocol`` is a leaf); field order is the wire order, and
fields are only ever appended with a default.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHashValue = bytes | int  # vLLM's ExternalBlockHash: digest bytes, or a 64-bit int
MEDIUM_DEVICE = "GPU"  # vLLM names the medium holding a block; mmis's KV pool is this one
# the utility call (P0 -> P1) that empties the prefix cache, announced as AllBlocksCleared
RESET_PREFIX_CACHE = "reset_prefix_cache"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change to the engine's prefix cache (the ``type`` tag is the class name)."""


class BlockStored(KVCacheEvent):
    """Full blocks registered in the prefix cache, in chain order."""

    block_hashes: list[BlockHashValue]
    parent_block_hash: BlockHashValue | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # one entry per block: the untagged extra keys, e.g. (mm_hash, offset) pairs
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHashValue]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class MMEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change to the engine's multimodal (receiver) cache, keyed by the item's ``mm_hash``."""


class EpochStarted(MMEvent):
    """First event after an engine start: everything announced before is gone."""

    epoch: str  # the receiver cache's (a new one on every engine start)


class MMItemStored(MMEvent):
    mm_hash: str
    nbytes: int


class MMItemEvicted(MMEvent):
    mm_hash: str


class MMEventBatch(EventBatch):
    events: list[EpochStarted | MMItemStored | MMItemEvicted]


KV_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
MM_DECODER = msgspec.msgpack.Decoder(MMEventBatch)
