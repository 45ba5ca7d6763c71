"""Drift between P0's shadow and P1's receiver cache, at the boundary of a real engine.

S1a (P1's budget smaller than P0's / than an item), S1b (P1 restarted), S1d (the
operator-only fault knob) and S2 (several drifted items in one request): a ``data=None``
item P1 does not hold is answered with ONE error output naming every missing hash, the
engine keeps serving, and resending the data gives tokens identical to ``generate()``.
Budget evictions are reported to P0 (``evicted_mm_hashes``); the knob's are silent.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness, Result
from engine_inputs import ModelKit, hash_only, image, kit_for, renamed, with_data

from mmis.config import GiB
from mmis.multimodal.cache import item_nbytes

pytestmark = [pytest.mark.model, pytest.mark.slow]

TEXT = "Describe this image in one short sentence, please."


def reported(engine: EngineHarness) -> set[str]:
    return {h for batch in engine.batches for h in batch.evicted_mm_hashes}


def assert_miss(res: Result, hashes: list[str]) -> None:
    assert res.error is not None, "expected a multimodal cache miss"
    assert res.error.code == "multimodal_cache_miss"
    assert res.error.retryable is True
    assert res.finish_reason == {0: "error"}
    assert res.missing_mm_hashes == hashes
    assert res.num_outputs == 1  # one error output, not one per item
    assert res.token_ids == []


@pytest.fixture(scope="module")
def llava(tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for("llava", tiny_dirs["llava"])


@pytest.fixture(scope="module")
def qwen(tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for("qwen2-vl", tiny_dirs["qwen2-vl"])


@pytest.fixture(scope="module")
def knob(llava: ModelKit) -> Iterator[EngineHarness]:
    with EngineHarness(llava.path, "--fault-evict-rate", "1", "--seed", "0") as eng:
        yield eng


@pytest.fixture(scope="module")
def item_bytes(qwen: ModelKit) -> int:
    data = qwen.request(TEXT, [image(0)]).mm_features[0].data
    assert isinstance(data, dict)
    return item_nbytes(data)


@pytest.fixture(scope="module")
def budget(qwen: ModelKit, item_bytes: int) -> Iterator[EngineHarness]:
    """P1 holds two and a half 64x64 items: the third evicts the first (S1a)."""
    gb = repr(2.5 * item_bytes / GiB)
    with EngineHarness(qwen.path, "--engine-mm-cache-gb", gb, transport="tcp") as eng:
        yield eng


# ------------------------------------------------------------------ S1d: the fault knob
def test_fault_knob_logs_loudly_and_its_miss_heals(llava: ModelKit, knob: EngineHarness) -> None:
    assert "FAULT INJECTION ON" in knob.log_text()
    assert knob.call("set_fault_evict_rate", 1.0) == 1.0
    images = [image(600)]
    expected = llava.reference(TEXT, images, 8)
    base = llava.request(TEXT, images, max_tokens=8)
    mm_hash = base.mm_features[0].mm_hash
    before = knob.call("receiver_stats")
    [stored] = knob.run(base)  # not cached yet: nothing to evict, the item is stored
    [missed] = knob.run(hash_only(base))  # the knob evicts it on purpose before resolving
    assert stored.token_ids == expected
    assert_miss(missed, [mm_hash])
    after = knob.call("receiver_stats")
    assert after["fault_evictions"] - before["fault_evictions"] == 1
    assert mm_hash not in reported(knob), "knob evictions must be silent"
    assert knob.call("set_fault_evict_rate", 0.0) == 0.0
    assert "fault evict rate set to 0.000" in knob.log_text()
    [healed] = knob.run(renamed(base))
    [shadow_hit] = knob.run(hash_only(base))  # the knob is off: the item stays held
    assert healed.token_ids == expected
    assert shadow_hit.error is None and shadow_hit.token_ids == expected
    assert knob.alive


def test_fault_rate_out_of_range_is_refused(knob: EngineHarness) -> None:
    with pytest.raises(RuntimeError, match="within"):
        knob.call("set_fault_evict_rate", 1.5)
    assert knob.call("set_fault_evict_rate", 0.0) == 0.0


def test_reset_mm_cache_announces_a_new_epoch(llava: ModelKit, knob: EngineHarness) -> None:
    knob.call("set_fault_evict_rate", 0.0)
    req = llava.request(TEXT, [image(650)], max_tokens=4)
    [first] = knob.run(req)
    old_epoch = knob.batches[-1].cache_epoch
    assert knob.call("reset_mm_cache") is True
    seen = len(knob.batches)
    [missed] = knob.run(hash_only(req))
    assert_miss(missed, [req.mm_features[0].mm_hash])
    epochs = {b.cache_epoch for b in knob.batches[seen:]}
    assert len(epochs) == 1 and old_epoch not in epochs, "P0 must learn its shadow is stale"
    assert knob.call("hello")["cache_epoch"] in epochs
    [healed] = knob.run(renamed(req))
    assert healed.token_ids == first.token_ids


# ------------------------------------------------------------------ S2: m of k items drifted
def test_several_drifted_items_give_one_error_and_one_retry_heals(
    llava: ModelKit, knob: EngineHarness
) -> None:
    knob.call("set_fault_evict_rate", 0.0)
    images = [image(700 + i) for i in range(4)]
    expected = llava.reference(TEXT, images, 8)
    full = llava.request(TEXT, images, max_tokens=8)
    data = [f.data for f in full.mm_features]
    hashes = [f.mm_hash for f in full.mm_features]
    before = knob.call("receiver_stats")
    [res] = knob.run(with_data(full, [None, data[1], None, data[3]]))
    assert_miss(res, [hashes[0], hashes[2]])
    after = knob.call("receiver_stats")
    assert after["stored"] - before["stored"] == 2  # the k - m good items were ingested
    assert after["entries"] - before["entries"] == 2
    # the retry needs to carry only the missing items: the good ones are held now
    [retry] = knob.run(with_data(full, [data[0], None, data[2], None]))
    assert retry.error is None, retry.error
    assert retry.token_ids == expected
    [full_retry] = knob.run(renamed(full))
    assert full_retry.token_ids == expected


# ------------------------------------------------------------------ S1a: a smaller P1 budget
def test_budget_evictions_are_reported_and_the_miss_heals(
    qwen: ModelKit, budget: EngineHarness
) -> None:
    requests = [qwen.request(TEXT, [image(800 + i)], max_tokens=6) for i in range(3)]
    results = budget.run(*requests)
    assert all(r.error is None for r in results)
    first_hash = requests[0].mm_features[0].mm_hash
    assert first_hash in reported(budget), "a budget eviction must be reported to P0"
    [missed] = budget.run(hash_only(requests[0]))
    assert_miss(missed, [first_hash])
    [healed] = budget.run(renamed(requests[0]))
    assert healed.token_ids == results[0].token_ids == qwen.reference(TEXT, [image(800)], 6)
    assert budget.alive


# ------------------------------------------------------------------ S1b + S1a: restarted smaller
def test_restart_changes_the_epoch_and_an_item_over_the_budget_is_never_held(
    qwen: ModelKit, budget: EngineHarness, item_bytes: int
) -> None:
    """P1 is killed and restarted with a budget smaller than one item: the next outputs carry
    a new epoch, held items are gone (miss), and an item over the budget is served, never
    held (every later shadow hit misses), never a crash."""
    old_epoch = budget.hello["cache_epoch"]
    images = [image(1000)]
    req = qwen.request(TEXT, images, max_tokens=6)
    [before] = budget.run(req)
    assert before.token_ids == qwen.reference(TEXT, images, 6)
    assert budget.batches[-1].cache_epoch == old_epoch
    budget.kill()  # a crashed P1; P0 (this client) keeps its shadow
    seen = len(budget.batches)
    budget.restart("--engine-mm-cache-gb", repr(0.5 * item_bytes / GiB))
    assert budget.hello["cache_epoch"] != old_epoch
    [missed] = budget.run(hash_only(req))
    assert_miss(missed, [req.mm_features[0].mm_hash])
    assert {b.cache_epoch for b in budget.batches[seen:]} == {budget.hello["cache_epoch"]}
    stats = budget.call("receiver_stats")
    [healed] = budget.run(renamed(req))
    assert healed.error is None and healed.token_ids == before.token_ids
    assert budget.call("receiver_stats")["oversize"] - stats["oversize"] == 1
    [again] = budget.run(hash_only(req))
    assert_miss(again, [req.mm_features[0].mm_hash])
    [other] = budget.run(qwen.request(TEXT, [image(1001)], max_tokens=6))
    assert other.error is None and budget.alive  # the engine keeps serving
