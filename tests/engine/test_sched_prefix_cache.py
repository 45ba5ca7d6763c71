"""Scheduler: prefix caching.

A prefix hit skips computed tokens but the last prompt token is always computed; blocks are
shared only after the step that computed them has run; the same tokens with different images
never share the blocks that cover the image.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import IMG, Engine, image, make, reference, scheduled, text


def test_prefix_hit_skips_computed_tokens():
    eng = Engine(block_size=4, num_blocks=64)
    shared = text(7, 40)
    eng.add(make("first", shared, max_tokens=2))
    eng.run()
    eng.add(make("second", [*shared, 1, 2, 3], max_tokens=2))
    out, events = eng.step()
    (item,) = out.scheduled
    assert item.start_position == 40 and item.token_ids == [1, 2, 3]
    assert events[0].num_cached_tokens == 40
    eng.run()
    assert eng.outputs["second"] == reference([*shared, 1, 2, 3], [], 2)
    stats = eng.sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40 + 43, 40)


def test_a_repeated_prompt_still_computes_its_last_token():
    eng = Engine(block_size=4, num_blocks=64)
    eng.add(make("first", text(8, 16), max_tokens=1))
    eng.run()
    eng.add(make("again", text(8, 16), max_tokens=1))
    out, _ = eng.step()
    assert out.scheduled[0].start_position == 12 and len(out.scheduled[0].token_ids) == 4
    assert eng.outputs["again"] == eng.outputs["first"]


def test_blocks_are_shared_only_after_the_step_that_computes_them():
    eng = Engine(block_size=4, num_blocks=64)
    eng.add(make("one", text(6, 20), max_tokens=2), make("two", text(6, 20), max_tokens=2))
    out, _ = eng.step()
    assert [s.start_position for s in out.scheduled] == [0, 0]  # same pass: no hit yet
    eng.add(make("three", text(6, 20), max_tokens=2))
    out, _ = eng.step()
    three = scheduled(out, "three")
    assert three is not None and three.start_position == 16
    eng.run()
    assert eng.outputs["one"] == eng.outputs["two"] == eng.outputs["three"]


def test_different_images_at_the_same_tokens_do_not_share_blocks():
    prompt = [*text(9, 6), *[IMG] * 8, *text(10, 6)]  # image at [6, 14)
    eng = Engine(block_size=4, num_blocks=64)
    eng.add(make("cat", prompt, image("cat", 6, 8), max_tokens=3))
    eng.run()
    eng.add(make("dog", prompt, image("dog", 6, 8), max_tokens=3))
    out, _ = eng.step()
    (item,) = out.scheduled
    assert item.start_position == 4  # only the block before the image is shared
    assert [item.mm_items[i].mm_hash for i in item.encoder_inputs] == ["dog"]
    eng.run()
    assert eng.outputs["dog"] == reference(prompt, [image("dog", 6, 8)], 3)
    assert eng.outputs["dog"] != eng.outputs["cat"]
    # the same image again hits past the image: no encoder run at all
    eng.add(make("cat2", prompt, image("cat", 6, 8), max_tokens=3))
    out, _ = eng.step()
    assert out.scheduled[0].start_position == 16 and out.scheduled[0].encoder_inputs == []
    eng.run()
    assert eng.outputs["cat2"] == eng.outputs["cat"]


def test_a_skip_cache_request_neither_reads_nor_writes_the_prefix_cache():
    eng = Engine(block_size=4, num_blocks=64)
    shared = text(9, 40)
    eng.add(make("warm", shared, max_tokens=2))
    eng.run()
    reader = make("reader", [*shared, 1, 2, 3], max_tokens=2)
    reader.skip_cache = True
    eng.add(reader)
    out, _ = eng.step()
    assert out.scheduled[0].start_position == 0  # the cached prefix is not read
    eng.run()
    assert eng.outputs["reader"] == reference([*shared, 1, 2, 3], [], 2)
    assert eng.finished["reader"].num_cached_tokens == 0
    stats = eng.sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40, 0)  # no lookup
    writer = make("writer", text(5, 24), max_tokens=1)
    writer.skip_cache = True
    eng.add(writer)
    eng.run()
    eng.add(make("follower", [*text(5, 24), 9], max_tokens=1))
    out, _ = eng.step()
    follower = scheduled(out, "follower")
    assert follower is not None and follower.start_position == 0  # nothing was written
    eng.run()
    eng.assert_pool_empty()
