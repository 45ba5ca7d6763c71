"""Scheduler: the encoder cache seen through scheduling passes (S8 included).

An image larger than the cache is rejected; entries evicted and re-allocated in one pass are
not reported as freed (S8); an output is released once its request has passed it, and stays
referenced until the step that uses it has run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import IMG, Engine, image, make, reference, scheduled, text

from mmis.protocol.messages import ErrorCode, FinishReason


def test_an_image_larger_than_the_encoder_cache_is_rejected():
    eng = Engine(block_size=4, num_blocks=64, encoder_cache_size=8)
    eng.add(make("big", [1, *[IMG] * 9], image("big", 1, 9)), make("ok", [1, 2, 3]))
    eng.run()
    err = eng.finished["big"].error
    assert err is not None and err.code == ErrorCode.INVALID_REQUEST.value and "big" in err.message
    assert eng.outputs["ok"] == reference([1, 2, 3], [], 4)


def _s8_engine() -> Engine:
    """Encoder cache of 8 slots; a and b (4 each) are encoded, then freed by their requests."""
    eng = Engine(
        block_size=4,
        num_blocks=17,  # 64 token slots
        max_num_batched_tokens=64,
        encoder_cache_size=8,
        encoder_compute_budget=16,
    )
    eng.add(make("A", [11, 12, *[IMG] * 4, 13], image("a", 2, 4), max_tokens=1))
    eng.add(make("B", [21, 22, *[IMG] * 4, 23], image("b", 2, 4), max_tokens=1))
    eng.step()
    assert set(eng.finished) == {"A", "B"}
    assert eng.sched.encoder_cache.num_freeable_slots == 8  # a and b kept, unreferenced
    return eng


def test_s8_evict_then_reallocate_in_one_pass_through_the_scheduler():
    eng = _s8_engine()
    # c (8) evicts a and b; its request can never fit the KV pool, so its admission is rolled
    # back in the same pass; then D needs a again
    eng.add(make("C", [31, 32, *[IMG] * 8, *text(5, 70)], image("c", 2, 8)))
    eng.add(make("D", [41, 42, *[IMG] * 4, 43], image("a", 2, 4), max_tokens=1))
    out, events = eng.step()
    assert eng.sched.encoder_cache.num_evictions == 2
    assert out.freed_encoder_hashes == ["b"]  # exactly: a naive report says ["a", "b"]
    (item,) = out.scheduled
    assert item.request_id == "D" and item.encoder_inputs == [0]
    assert events[0].request_id == "C" and events[0].finish_reason == FinishReason.ERROR
    assert eng.runner.encoder_store == {"a": "a"}
    assert eng.outputs["D"] == reference([41, 42, *[IMG] * 4, 43], [image("a", 2, 4)], 1)


def test_s8_evictions_by_two_admissions_in_one_pass():
    eng = _s8_engine()
    eng.add(make("C", [31, 32, *[IMG] * 4, 33], image("c", 2, 4), max_tokens=1))  # evicts a
    eng.add(make("D", [41, 42, *[IMG] * 4, 43], image("a", 2, 4), max_tokens=1))  # evicts b
    out, _ = eng.step()
    assert [s.request_id for s in out.scheduled] == ["C", "D"]
    assert out.freed_encoder_hashes == ["b"]
    assert sorted(eng.runner.encoder_store) == ["a", "c"]
    eng.run()
    assert eng.outputs["D"] == reference([41, 42, *[IMG] * 4, 43], [image("a", 2, 4)], 1)


def test_an_encoder_output_is_released_once_the_request_has_passed_it():
    eng = Engine(block_size=4, num_blocks=64, encoder_cache_size=8)
    eng.add(make("A", [1, *[IMG] * 8, 2], image("a", 1, 8), max_tokens=10))
    eng.step()  # A's prefill consumed a; A keeps decoding
    assert eng.sched.encoder_cache.refs("a") == frozenset()
    eng.add(make("B", [3, *[IMG] * 8, 4], image("b", 1, 8), max_tokens=1))
    out, _ = eng.step()
    item = scheduled(out, "B")
    assert item is not None and item.encoder_inputs == [0]  # a was evicted for b
    assert out.freed_encoder_hashes == ["a"] and scheduled(out, "A") is not None
    eng.run()
    assert eng.outputs["A"] == reference([1, *[IMG] * 8, 2], [image("a", 1, 8)], 10)


def test_an_encoder_output_stays_referenced_until_its_step_has_run():
    # a is allocated for A's chunk in this pass; B must not evict it for b in the same pass
    eng = Engine(block_size=4, num_blocks=64, encoder_cache_size=8, encoder_compute_budget=16)
    eng.add(make("A", [1, *[IMG] * 8, 2], image("a", 1, 8), max_tokens=1))
    eng.add(make("B", [3, *[IMG] * 8, 4], image("b", 1, 8), max_tokens=1))
    out, _ = eng.step()
    assert out.freed_encoder_hashes == []
    assert [(s.request_id, len(s.token_ids), s.encoder_inputs) for s in out.scheduled] == [
        ("A", 10, [0]),
        ("B", 1, []),  # stops before b: the cache is full until A's step has run
    ]
    eng.run()
    assert eng.runner.encoded == [(1, "a"), (2, "b")]
