"""The KV cache manager: per-request block tables over a :class:`BlockPool`, with prefix caching.

Prefix-cache hashes are the chained block keys of ``protocol/block_keys.py`` (P0 computes the
same ones for routers): each covers its parent, its tokens and the multimodal items it
overlaps, so the same placeholder tokens with a different image, or the same image at
another offset, never share a block.

Invariants:
- A block is registered in the prefix cache only after the step that computes all its tokens
  has completed (:meth:`KVCacheManager.cache_computed_blocks`), so a lookup never returns a
  block whose KV is still being written.
- A lookup never covers the whole prompt: at least one token is left to compute, to get logits.
- :meth:`allocate_slots` is all-or-nothing: on failure it returns ``None`` and changes nothing.
- Blocks are freed tail first, so a request's later blocks are evicted before its prefix.
- A ``skip_cache`` request neither reads nor writes the prefix cache (no hit, none of its
  blocks registered); its blocks are private and freed like any other.
- Block 0 is the reserved null block (see ``block_pool``); it is never in a block table.
- Block tables are persistent: ``block_ids[request_id]`` is ONE list per admission, kept in
  step with ``req_blocks`` by appending (a new block appends its id; nothing is rebuilt or
  reordered while the request holds its blocks). :meth:`block_table` and
  :meth:`allocate_slots` return that list itself, not a copy, so a step costs what its new
  blocks cost, whatever the context; the list is never changed after :meth:`free` (a request
  admitted again gets a new list). The runner keeps its device rows in step with these lists
  the same way (``block_tables.BlockTables``). Callers read it, never change it.
- ``request.kv_capacity`` is ``len(block_ids[request_id]) * block_size`` while the request
  holds blocks, else 0 (set by :meth:`allocate_slots` and :meth:`free`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmis.engine.scheduling.block_pool import BlockHash, BlockPool, KVBlock
from mmis.engine.scheduling.request import Request
from mmis.protocol.block_keys import block_extra_keys, chain

if TYPE_CHECKING:
    from mmis.engine.kv_events import KVEventLog


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
    return chain(
        request.all_token_ids,
        request.mm_features,
        block_size,
        request.block_hashes,
        request.lora_id,
    )


@dataclasses.dataclass
class PrefixCacheStats:
    """Counted per admitted request: ``queries`` prompt tokens looked up, ``hits`` found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.block_ids: dict[str, list[int]] = {}  # the ids of req_blocks, append-only
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` fit in the pool even with every other request evicted."""
        return self.blocks_needed(num_tokens) <= self.num_usable_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids: the persistent list itself (read only; empty: a new one)."""
        ids = self.block_ids.get(request_id)
        return [] if ids is None else ids

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``request`` (blocks, tokens), never the whole of it."""
        pooling = request.pooling_params
        if (
            not self.enable_prefix_caching
            or request.skip_cache
            or (request.is_pooling and pooling is not None and pooling.pooling_type == "mean")
        ):  # mean pooling needs the hidden state of every prompt token: never a hit
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        # at least one token must be computed: the last block may not be a hit if it ends
        # exactly at the request's last token
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> list[int] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens after its computed ones.

        ``new_computed_blocks`` (a prefix hit, only at admission) are shared, not copied; the
        caller then sets ``num_computed_tokens`` to their length. Returns the full block table
        or ``None`` (nothing changed) when the pool is short. The table is the request's
        persistent id list (see the module docstring), extended in place.
        """
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            blocks = []
        elif not new_computed_blocks and (
            request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size
        ):  # the held blocks have room (a decode step inside its last block): nothing to do
            return self.block_ids[rid]
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_required = self.blocks_needed(total) - len(blocks) - len(new_computed_blocks)
        num_required = max(num_required, 0)
        reviving = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_required > self.pool.num_free_blocks - reviving:
            return None
        if new_computed_blocks and request.request_id in self.req_blocks:
            raise ValueError(f"{request.request_id!r}: a prefix hit is only taken at admission")
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_required)
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self.block_ids.setdefault(rid, [])
        if new_computed_blocks:
            # a prefix hit: those blocks are cached already, registration resumes after them
            self._num_cached_blocks[rid] = len(blocks) + len(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        ids.extend([b.block_id for b in new_computed_blocks])
        ids.extend([b.block_id for b in new_blocks])
        request.kv_capacity = len(ids) * self.block_size
        return ids

    def cache_computed_blocks(self, request: Request, computed: int | None = None) -> None:
        """Register the full blocks whose tokens are all computed (after the step ran);
        ``computed``: the tokens the step computed (default ``num_computed_tokens``, which a
        pass scheduled since may have advanced past the tokens known on the host)."""
        if not self.enable_prefix_caching or request.skip_cache:
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        if computed is None:
            computed = request.num_computed_tokens
        num_full = min(computed // self.block_size, len(blocks))
        done = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = update_block_hashes(request, self.block_size)
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full
        if self.pool.events is not None:
            self._announce(self.pool.events, request, hashes, done, num_full)

    def _announce(
        self, log: KVEventLog, request: Request, hashes: list[BlockHash], done: int, end: int
    ) -> None:
        """Record blocks ``[done, end)`` of ``request`` as stored (engine/kv_events.py)."""
        size = self.block_size
        features = request.mm_features
        extra = [
            block_extra_keys(features, i * size, (i + 1) * size) if features else []
            for i in range(done, end)
        ]
        log.stored(
            hashes[done:end],
            hashes[done - 1] if done else None,
            request.all_token_ids[done * size : end * size],
            extra,
            lora_id=request.lora_id or None,
            lora_name=request.lora_name,
        )

    def free(self, request: Request) -> None:
        """Release every block of ``request``; tail blocks become evictable first."""
        request.kv_capacity = 0
        blocks = self.req_blocks.pop(request.request_id, None)
        self.block_ids.pop(request.request_id, None)  # dropped, not cleared: see the docstring
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        self._num_cached_blocks = {rid: len(b) for rid, b in self.req_blocks.items()}
        return self.pool.reset_prefix_cache()
