"""KV block pool and prefix caching: chained hashes, lookups, LRU eviction, accounting."""

from __future__ import annotations

import pytest

from mmis.engine.scheduling.block_pool import NULL_BLOCK_ID, BlockPool, BlockPoolError
from mmis.engine.scheduling.kv_cache import KVCacheManager, update_block_hashes
from mmis.engine.scheduling.request import Request
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange

BS = 4


def image(ident: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(
        modality="image", mm_hash=ident, placeholder=PlaceholderRange(offset, length)
    )


def req(rid: str, tokens: list[int], *features: MultiModalFeature) -> Request:
    return Request(rid, tokens, mm_features=features)


def run_prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit ``request`` like the scheduler does and mark its whole prompt computed."""
    blocks, hit = kv.get_computed_blocks(request)
    table = kv.allocate_slots(request, request.num_tokens - hit, blocks)
    assert table is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return table


def test_hashes_chain_and_depend_on_every_earlier_token():
    a = req("a", list(range(12)))
    b = req("b", [*range(4), 99, *range(5, 12)])
    ha, hb = update_block_hashes(a, BS), update_block_hashes(b, BS)
    assert len(ha) == 3
    assert ha[0] == hb[0]
    assert ha[1] != hb[1] and ha[2] != hb[2]  # block 2 has equal tokens, different parent


def test_same_tokens_with_a_different_image_never_share_a_block():
    tokens = [1, 2, 7, 7, 7, 7, 7, 7, 3, 4, 5, 6]
    x = update_block_hashes(req("x", tokens, image("img-x", 2, 6)), BS)
    y = update_block_hashes(req("y", tokens, image("img-y", 2, 6)), BS)
    plain = update_block_hashes(req("p", tokens), BS)
    assert x[0] != y[0] and x[1] != y[1] and x[2] != y[2]
    assert x[0] != plain[0]


def test_the_same_image_at_another_offset_does_not_share_a_block():
    tokens = [1, 7, 7, 7, 7, 7, 7, 7]
    early = update_block_hashes(req("e", tokens, image("img", 1, 6)), BS)
    late = update_block_hashes(req("l", tokens, image("img", 2, 6)), BS)
    assert early[0] != late[0] and early[1] != late[1]


def test_prefix_hit_shares_blocks_and_never_covers_the_whole_prompt():
    kv = KVCacheManager(16, BS)
    first = req("first", list(range(12)))
    table = run_prefill(kv, first)
    kv.free(first)
    again = req("again", list(range(12)))  # identical prompt: 3 full blocks cached
    blocks, hit = kv.get_computed_blocks(again)
    assert hit == 8  # the last block is recomputed to get logits
    assert [b.block_id for b in blocks] == table[:2]
    longer = req("longer", [*range(12), 50, 51])
    blocks, hit = kv.get_computed_blocks(longer)
    assert hit == 12 and [b.block_id for b in blocks] == table


def test_prefix_hit_revives_free_blocks_and_counts_them_as_used():
    kv = KVCacheManager(9, BS)
    first = req("first", list(range(8)))
    run_prefill(kv, first)
    kv.free(first)
    assert kv.usage() == 0.0
    second = req("second", [*range(8), 1])
    table = run_prefill(kv, second)
    assert len(table) == 3
    assert kv.num_free_blocks == 8 - 3
    assert kv.usage() == pytest.approx(3 / 8)


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    big = req("big", list(range(12)))
    assert kv.allocate_slots(big, 12) is not None
    other = req("other", list(range(100, 108)))
    assert kv.allocate_slots(other, 8) is None
    assert kv.num_free_blocks == 1 and kv.block_table("other") == []
    assert kv.allocate_slots(other, 4) is not None


def test_blocks_never_include_the_null_block():
    kv = KVCacheManager(4, BS)
    request = req("r", list(range(12)))
    table = kv.allocate_slots(request, 12)
    assert table is not None and NULL_BLOCK_ID not in table
    assert kv.allocate_slots(req("s", [1]), 1) is None


def test_uncached_blocks_are_reused_before_cached_ones_are_evicted():
    kv = KVCacheManager(7, BS)  # 6 usable
    cached = req("cached", list(range(8)))
    run_prefill(kv, cached)
    kv.free(cached)  # 2 cached-but-free blocks
    scratch = req("scratch", list(range(50, 54)))
    kv.allocate_slots(scratch, 4)  # 1 block, never computed -> uncached when freed
    kv.free(scratch)
    user = req("user", list(range(200, 216)))
    kv.allocate_slots(user, 16)  # 4 blocks: all the uncached ones, no eviction
    assert kv.pool.num_evictions == 0
    assert kv.get_computed_blocks(req("probe", [*range(8), 9]))[1] == 8


def test_cached_blocks_are_evicted_least_recently_freed_first_tail_first():
    kv = KVCacheManager(7, BS)
    old = req("old", list(range(8)))
    new = req("new", list(range(100, 108)))
    run_prefill(kv, old)
    run_prefill(kv, new)
    kv.free(old)
    kv.free(new)
    kv.allocate_slots(req("filler", list(range(300, 312))), 12)  # 2 uncached + 1 eviction
    assert kv.pool.num_evictions == 1
    # the evicted block is old's *tail*: its first block still hits
    assert kv.get_computed_blocks(req("p1", [*range(8), 1]))[1] == 4
    assert kv.get_computed_blocks(req("p2", [*range(100, 108), 1]))[1] == 8


def test_prefix_stats_and_free_restores_the_pool():
    kv = KVCacheManager(16, BS)
    first = req("first", list(range(10)))
    run_prefill(kv, first)
    kv.record_prefix_lookup(10, 0)
    second = req("second", list(range(10)))
    _, hit = kv.get_computed_blocks(second)
    kv.record_prefix_lookup(10, hit)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (20, 8)
    assert kv.prefix_stats.hit_rate == pytest.approx(0.4)
    kv.free(first)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_double_free_is_detected():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free_blocks([block])
    with pytest.raises(BlockPoolError, match="asked for"):
        pool.get_new_blocks(4)
