"""The pool of paged KV blocks: ids, reference counts, a free queue and the prefix-cache map.

Layout contract (shared with the torch side): KV memory per layer is ``num_blocks`` blocks of
``block_size`` tokens; the token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Invariants:
- Block 0 is the *null block*: never handed out, never freed, never cached. Runners may pad
  block tables with it; its slots hold garbage and must never be read for a real token.
- A block is in the free queue exactly when its ``ref_cnt`` is 0 (the null block excepted).
- A free block may still carry a ``block_hash``: its KV content stays valid and reusable until
  the block is handed out again (lazy eviction). The free queue is the eviction order:
  uncached free blocks sit at the head (reused first), cached ones join at the tail, so cached
  content is evicted least-recently-freed first, and only when no uncached block is left.
- ``cached`` maps a hash to the one block that holds that content; a block is in ``cached``
  exactly when its ``block_hash`` is set.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmis.engine.kv_events import KVEventLog

BlockHash = bytes

NULL_BLOCK_ID = 0


class BlockPoolError(RuntimeError):
    """The pool's bookkeeping was asked to do something impossible (a caller bug)."""


class KVBlock:
    """One block of ``block_size`` token slots (per layer)."""

    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else " cached"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """A doubly linked list of free blocks: O(1) push at either end, pop at the head, and
    removal from the middle (a cached block revived by a prefix hit)."""

    def __init__(self) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def _link(self, block: KVBlock, before: KVBlock) -> None:
        after_prev = before.prev
        if after_prev is None:  # pragma: no cover - sentinels always linked
            raise BlockPoolError("free queue is corrupt")
        block.prev, block.next = after_prev, before
        after_prev.next = block
        before.prev = block
        self.size += 1

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next
        if first is None:  # pragma: no cover
            raise BlockPoolError("free queue is corrupt")
        self._link(block, first)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise BlockPoolError(f"{block!r} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise BlockPoolError("no free block left")
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """Owns every block; hands out, revives, frees and caches them."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # permanently "in use"
        self.free_queue = FreeBlockQueue()
        for block in self.blocks[1:]:
            self.free_queue.append(block)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.events: KVEventLog | None = None  # set to announce evictions (engine/kv_events.py)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including cached-but-free ones)."""
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of usable blocks referenced by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks from the head of the free queue, evicting cached content."""
        if count > self.num_free_blocks:
            raise BlockPoolError(f"asked for {count} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix hit), reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (first = evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise BlockPoolError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register ``block`` as holding ``block_hash``; False if another block already does."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their content). Returns the count."""
        count = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        # Former cached-but-free blocks are now plain free blocks; their position in the
        # queue no longer matters because none of them holds reusable content.
        return count
