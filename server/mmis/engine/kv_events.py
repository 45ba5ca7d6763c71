"""The prefix cache's changes as vLLM's KV events, collected per step and published once
(docs/ROUTING.md; wire format in ``protocol/kv_events.py``, sockets in
``engine/event_publisher.py``).

Who records what:
- ``KVCacheManager.cache_computed_blocks`` calls :meth:`KVEventLog.stored` for the blocks
  it registered, in chain order, with their parent hash, tokens and extra keys;
- ``BlockPool.get_new_blocks`` calls :meth:`KVEventLog.removed` for each cached block it
  evicts; ``BlockPool.reset_prefix_cache`` calls :meth:`KVEventLog.cleared`;
- the engine core calls :meth:`KVEventStream.flush` after each step and after a reset.

Invariants:
- With no log attached (the default) the cache does no event work at all.
- ``BlockStored.token_ids`` is empty unless the log was made with ``token_ids=True``
  (``--kv-events-token-ids``): the tokens are the prompt in clear text, and anyone admitted
  to the stream would read them (issue 41). The field stays on the wire, so vLLM's decoders
  still decode; routers key on the hashes alone.
- A batch keeps the order the cache changed in. A removal that follows a removal joins its
  event. ``cleared`` drops whatever is still pending: everything before it is void.
- A new stream's first batch is ``AllBlocksCleared``. A router that saw this engine's
  previous life (same address) then drops what it knew.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmis.engine.event_publisher import EventPublisher, EventStream
from mmis.protocol.kv_events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored

Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Pending prefix-cache events since the last :meth:`drain`."""

    def __init__(self, block_size: int, *, token_ids: bool = False) -> None:
        self.block_size = block_size
        self.token_ids = token_ids  # announce the blocks' tokens (off: an empty list)
        self._events: list[Event] = []

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        extra_keys: Sequence[Sequence[tuple[Any, ...]]],
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Blocks registered in chain order; ``extra_keys`` has one list per block;
        ``token_ids`` are announced only if this log was made to; ``lora_id`` /
        ``lora_name``: the adapter they were computed under (vLLM's fields; None: base)."""
        # vLLM's event shape: per block, a tuple of (mm_hash, offset) pairs, or None
        entries = [tuple(tuple(k) for k in keys) or None for keys in extra_keys]
        self._events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids) if self.token_ids else [],
                block_size=self.block_size,
                lora_id=lora_id,
                medium=MEDIUM_DEVICE,
                lora_name=lora_name,
                extra_keys=entries if any(e is not None for e in entries) else None,
            )
        )

    def removed(self, block_hash: bytes) -> None:
        events = self._events
        if events and isinstance(events[-1], BlockRemoved):
            events[-1].block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_DEVICE))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]

    def drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events


class KVEventStream(EventStream):
    """The KV stream: opens with ``AllBlocksCleared``."""

    log: KVEventLog

    def __init__(self, log: KVEventLog, publisher: EventPublisher) -> None:
        super().__init__(log, publisher, [AllBlocksCleared()])
