"""The scheduler driven end to end against a simulated paged-KV runner.

``SlotRunner`` plays the model runner on the real layout contract: every scheduled token is
written into its slot (``block_table[p // bs] * bs + p % bs``) together with its image
embedding (looked up in the runner's encoder store, which obeys the freed-hash reports), and
sampling reads the whole context back *through the block table*. The sampled token is a hash
of that context, so a shared block with the wrong content, a missing encoder output or a
clobbered slot changes the output, and every test compares outputs with a reference computed
from the request's true tokens.
"""

from __future__ import annotations

import hashlib

import pytest

from mmis.server.engine.request import InvalidRequestError, Request
from mmis.server.engine.sched_config import SchedulerConfig
from mmis.server.engine.sched_output import RequestEvent, SchedulerOutput
from mmis.server.engine.scheduler import Scheduler
from mmis.server.protocol.messages import (
    ErrorCode,
    FinishReason,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
)

IMG = 7  # the placeholder token id
EOS = 2


def image(ident: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", ident, ident, PlaceholderRange(offset, length))


def make(
    rid: str,
    prompt: list[int],
    *features: MultiModalFeature,
    max_tokens: int = 4,
    arrival: float = 0.0,
    **params: object,
) -> Request:
    return Request(
        rid,
        prompt,
        mm_features=features,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        arrival_time=arrival,
        eos_token_id=EOS,
    )


def slot_value(token: int, pos: int, features: list[MultiModalFeature], store: dict | None):
    for f in features:
        if f.placeholder.offset <= pos < f.placeholder.offset + f.placeholder.length:
            emb = f.identifier if store is None else store[f.mm_hash]
            return (token, emb, pos - f.placeholder.offset)
    return (token, None, 0)


def next_token(context: list[tuple]) -> int:
    digest = hashlib.blake2b(repr(context).encode(), digest_size=4).digest()
    return 100 + int.from_bytes(digest, "big") % 100  # never EOS


def reference(prompt: list[int], features: list[MultiModalFeature], n: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        tok = next_token([slot_value(t, p, features, None) for p, t in enumerate(tokens)])
        out.append(tok)
        tokens.append(tok)
    return out


class EncoderMiss(AssertionError):
    pass


class SlotRunner:
    def __init__(self, block_size: int, script: dict[str, list[int]] | None = None) -> None:
        self.bs = block_size
        self.slots: dict[int, tuple] = {}
        self.written_at: dict[int, int] = {}  # slot -> step that wrote it
        self.encoder_store: dict[str, str] = {}
        self.encoded: list[tuple[int, str]] = []
        self.script = script or {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for mm_hash in out.freed_encoder_hashes:
            if mm_hash not in self.encoder_store:
                raise AssertionError(f"freed {mm_hash} that the runner never held")
            del self.encoder_store[mm_hash]
        for item in out.scheduled:
            for idx in item.encoder_inputs:
                feature = item.mm_features[idx]
                self.encoder_store[feature.mm_hash] = feature.identifier
                self.encoded.append((out.step, feature.mm_hash))
        sampled = {}
        for item in out.scheduled:
            assert 0 not in item.block_table  # the null block is never handed out
            for pos in range(item.start_position):  # computed KV exists before the step
                slot = self._slot(item.block_table, pos)
                assert self.written_at.get(slot, out.step) < out.step, (item.request_id, pos)
        for item in out.scheduled:
            for j, token in enumerate(item.token_ids):
                pos = item.start_position + j
                try:
                    value = slot_value(token, pos, item.mm_features, self.encoder_store)
                except KeyError as exc:
                    raise EncoderMiss(f"{item.request_id}: no encoder output {exc}") from exc
                self.slots[self._slot(item.block_table, pos)] = value
                self.written_at[self._slot(item.block_table, pos)] = out.step
            if item.sample:
                end = item.start_position + len(item.token_ids)
                context = [self.slots[self._slot(item.block_table, p)] for p in range(end)]
                script = self.script.get(item.request_id)
                sampled[item.request_id] = [script.pop(0) if script else next_token(context)]
        return sampled

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs


class Engine:
    """Scheduler + runner in the engine-core loop order: schedule, execute, update."""

    def __init__(self, script: dict[str, list[int]] | None = None, **cfg: object) -> None:
        self.sched = Scheduler(SchedulerConfig(**cfg))  # type: ignore[arg-type]
        self.runner = SlotRunner(self.sched.config.block_size, script)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, RequestEvent] = {}
        self.history: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.sched.add_request(r)
            self.outputs[r.request_id] = []

    def step(self) -> tuple[SchedulerOutput, list[RequestEvent]]:
        out = self.sched.schedule()
        self.history.append(out)
        events = self.sched.update_from_output(out, self.runner.execute(out))
        for ev in events:
            self.outputs[ev.request_id].extend(ev.new_token_ids)
            if ev.finished:
                self.finished[ev.request_id] = ev
        return out, events

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests() and not self.sched.has_pending_events():
                return
            self.step()
        raise AssertionError("the scheduler did not drain")

    def assert_pool_empty(self) -> None:
        kv = self.sched.kv
        assert kv.num_free_blocks == kv.num_usable_blocks and kv.usage() == 0.0
        assert kv.req_blocks == {}
        assert self.sched.encoder_cache.num_freeable_slots == self.sched.encoder_cache.num_slots


def text(seed: int, n: int) -> list[int]:
    return [10 + (seed * 31 + i * 7) % 80 for i in range(n)]


# -- continuous batching and chunked prefill -------------------------------------------------


def test_requests_join_and_leave_while_others_decode():
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=64)
    a, b = make("A", text(1, 9), max_tokens=8), make("B", text(2, 5), max_tokens=3)
    eng.add(a, b)
    out, _ = eng.step()
    assert {s.request_id for s in out.scheduled} == {"A", "B"}
    eng.step()  # both decode
    eng.add(make("C", text(3, 11), max_tokens=5))
    out, events = eng.step()
    by_id = {s.request_id: s for s in out.scheduled}
    assert by_id["C"].is_new and len(by_id["C"].token_ids) == 11  # C prefills ...
    assert len(by_id["A"].token_ids) == 1 and len(by_id["B"].token_ids) == 1  # ... others decode
    assert [e.request_id for e in events if e.finished] == ["B"]  # B leaves after 3 tokens
    out, _ = eng.step()
    assert out.finished_request_ids == ["B"]
    assert {s.request_id for s in out.scheduled} == {"A", "C"}  # the others continue
    eng.run()
    assert eng.outputs["A"] == reference(text(1, 9), [], 8)
    assert eng.outputs["B"] == reference(text(2, 5), [], 3)
    assert eng.outputs["C"] == reference(text(3, 11), [], 5)
    assert {r: e.finish_reason for r, e in eng.finished.items()} == dict.fromkeys(
        "ABC", FinishReason.LENGTH
    )
    eng.assert_pool_empty()


def test_chunked_prefill_respects_the_token_budget():
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=8)
    eng.add(make("long", text(4, 30), max_tokens=3), make("short", text(5, 3), max_tokens=6))
    positions: list[int] = []
    while eng.sched.has_unfinished_requests():
        out, _ = eng.step()
        assert 0 < out.num_scheduled_tokens <= 8
        for item in out.scheduled:
            if item.request_id == "long" and item.start_position < 30:
                assert item.start_position == sum(positions)  # contiguous chunks
                positions.append(len(item.token_ids))
                assert item.sample == (item.start_position + len(item.token_ids) == 30)
    assert sum(positions) == 30 and len(positions) >= 4
    assert eng.outputs["long"] == reference(text(4, 30), [], 3)
    assert eng.outputs["short"] == reference(text(5, 3), [], 6)


def test_max_num_seqs_bounds_the_running_set():
    eng = Engine(block_size=4, num_blocks=64, max_num_seqs=2)
    eng.add(*(make(f"r{i}", text(i, 4), max_tokens=3) for i in range(5)))
    while eng.sched.has_unfinished_requests():
        out, _ = eng.step()
        assert len(eng.sched.running) <= 2 and len(out.scheduled) <= 2
    assert all(eng.outputs[f"r{i}"] == reference(text(i, 4), [], 3) for i in range(5))


# -- stop conditions ----------------------------------------------------------------------------


def test_stop_conditions_without_a_tokenizer():
    script = {"eos": [150, EOS, 151], "stopid": [150, 42, 151], "ignore": [EOS, EOS, 160]}
    eng = Engine(script=script, block_size=4, num_blocks=64)
    eng.add(
        make("eos", text(1, 5), max_tokens=10),
        make("stopid", text(2, 5), max_tokens=10, stop_token_ids=[42]),
        make("ignore", text(3, 5), max_tokens=3, ignore_eos=True),
        make("strings", text(4, 5), max_tokens=10),
    )
    eng.step()
    eng.step()
    # the caller (who has the tokenizer) saw a stop string in "strings"
    assert eng.sched.finish_request("strings", FinishReason.STOP, stop_reason="###")
    eng.run()
    fin = eng.finished
    assert eng.outputs["eos"] == [150, EOS] and fin["eos"].finish_reason is FinishReason.STOP
    assert eng.outputs["stopid"] == [150, 42] and fin["stopid"].stop_reason == 42
    assert eng.outputs["ignore"] == [EOS, EOS, 160]
    assert fin["ignore"].finish_reason is FinishReason.LENGTH
    assert len(eng.outputs["strings"]) == 2 and "strings" not in fin
    eng.assert_pool_empty()


def test_max_model_len_stops_generation_and_rejects_long_prompts():
    eng = Engine(block_size=4, num_blocks=64, max_model_len=12)
    eng.add(make("fits", text(1, 8), max_tokens=50), make("long", text(2, 12)))
    eng.run()
    assert len(eng.outputs["fits"]) == 4
    assert eng.finished["fits"].finish_reason is FinishReason.LENGTH
    err = eng.finished["long"].error
    assert err is not None and err.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value


# -- prefix caching -----------------------------------------------------------------------------


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
    assert out.get("three") is not None and out.get("three").start_position == 16
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
    assert [item.mm_features[i].mm_hash for i in item.encoder_inputs] == ["dog"]
    eng.run()
    assert eng.outputs["dog"] == reference(prompt, [image("dog", 6, 8)], 3)
    assert eng.outputs["dog"] != eng.outputs["cat"]
    # the same image again hits past the image: no encoder run at all
    eng.add(make("cat2", prompt, image("cat", 6, 8), max_tokens=3))
    out, _ = eng.step()
    assert out.scheduled[0].start_position == 16 and out.scheduled[0].encoder_inputs == []
    eng.run()
    assert eng.outputs["cat2"] == eng.outputs["cat"]


# -- preemption, capacity, abort ----------------------------------------------------------------


def test_preemption_by_recompute_and_the_victim_completes():
    eng = Engine(block_size=4, num_blocks=6)  # 5 usable blocks; each request grows to 4
    eng.add(make("A", text(1, 8), max_tokens=8, arrival=1.0))
    eng.add(make("B", text(2, 8), max_tokens=8, arrival=2.0))
    eng.run()
    preempted = [rid for out in eng.history for rid in out.preempted_request_ids]
    assert preempted and set(preempted) == {"B"}  # the latest arrival is the victim
    resumed = [s for out in eng.history for s in out.scheduled if s.request_id == "B" and s.is_new]
    assert len(resumed) == len(preempted) + 1  # re-admitted after each preemption
    assert eng.outputs["A"] == reference(text(1, 8), [], 8)
    assert eng.outputs["B"] == reference(text(2, 8), [], 8)  # same count, same tokens
    assert eng.sched.num_preemptions == len(preempted)
    eng.assert_pool_empty()


def test_a_preempted_request_goes_back_to_the_front_of_the_queue():
    eng = Engine(block_size=4, num_blocks=4, max_num_seqs=2)  # 3 usable blocks
    eng.add(make("A", text(1, 4), arrival=1.0), make("B", text(2, 4), arrival=2.0))
    eng.add(make("C", text(3, 4), arrival=3.0))  # waits: max_num_seqs
    eng.run()
    admissions = [s.request_id for out in eng.history for s in out.scheduled if s.is_new]
    preempted = [rid for out in eng.history for rid in out.preempted_request_ids]
    assert preempted[0] == "B" and "A" not in preempted
    assert admissions[:4] == ["A", "B", "B", "C"]  # B is re-admitted before C ever starts
    assert all(eng.outputs[r] == reference(text(i, 4), [], 4) for i, r in enumerate("ABC", 1))


def test_a_request_that_can_never_fit_is_rejected_and_others_continue():
    eng = Engine(block_size=4, num_blocks=5)  # 16 token slots in all
    eng.add(make("huge", text(1, 20)), make("ok", text(2, 6), max_tokens=4))
    out, events = eng.step()
    assert [s.request_id for s in out.scheduled] == ["ok"]
    (ev,) = events[:1]
    assert ev.request_id == "huge" and ev.finish_reason is FinishReason.ERROR
    assert ev.error is not None and ev.error.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value
    assert not ev.error.retryable
    eng.run()
    assert eng.outputs["ok"] == reference(text(2, 6), [], 4)
    assert eng.sched.num_rejected == 1
    eng.assert_pool_empty()


def test_a_request_that_outgrows_the_pool_stops_instead_of_looping():
    eng = Engine(block_size=4, num_blocks=5)  # 16 token slots in all
    eng.add(make("grow", text(3, 12), max_tokens=10))
    eng.run(max_steps=30)
    assert eng.finished["grow"].finish_reason is FinishReason.LENGTH
    assert eng.outputs["grow"] == reference(text(3, 12), [], 5)  # KV for 16 tokens, +1 sampled
    eng.assert_pool_empty()


def test_abort_frees_everything():
    eng = Engine(block_size=4, num_blocks=16, max_num_seqs=2, encoder_cache_size=32)
    prompt = [*text(1, 4), *[IMG] * 8, 3]
    eng.add(
        make("run1", prompt, image("i1", 4, 8), max_tokens=20),
        make("run2", text(2, 9), max_tokens=20),
        make("wait", text(3, 5)),
    )
    eng.step()
    eng.step()
    assert eng.sched.kv.usage() > 0 and len(eng.sched.waiting) == 1
    assert sorted(eng.sched.abort_requests(["run1", "wait", "unknown"])) == ["run1", "wait"]
    out, _ = eng.step()
    assert sorted(out.finished_request_ids) == ["run1", "wait"]
    assert [s.request_id for s in out.scheduled] == ["run2"]
    assert eng.sched.abort_requests(["run2"]) == ["run2"]
    eng.assert_pool_empty()
    assert not eng.sched.has_unfinished_requests() and eng.sched.requests == {}
    assert eng.sched.schedule().is_empty


def test_bad_requests_raise_typed_errors():
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        Request("r", [])
    with pytest.raises(InvalidRequestError, match="outside the prompt"):
        Request("r", [1, 2, 3], mm_features=[image("x", 2, 4)])
    with pytest.raises(InvalidRequestError, match="overlapping"):
        Request("r", [IMG] * 8, mm_features=[image("x", 0, 5), image("y", 4, 4)])
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=8))
    sched.add_request(make("dup", [1]))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make("dup", [1]))


# -- multimodal: encoder scheduling and the encoder cache --------------------------------------


def test_an_image_is_encoded_only_when_its_range_is_reached_and_never_split():
    prompt = [*text(1, 10), *[IMG] * 16, *text(2, 14)]  # image at [10, 26)
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=20)
    eng.add(make("img", prompt, image("pic", 10, 16), max_tokens=2))
    chunks = []
    while eng.sched.has_unfinished_requests():
        out, _ = eng.step()
        for item in out.scheduled:
            encoded = [item.mm_features[i].mm_hash for i in item.encoder_inputs]
            chunks.append((item.start_position, len(item.token_ids), encoded))
    # [0, 20) would split the image: stop before it; then the whole image in one chunk
    assert chunks[:3] == [(0, 10, []), (10, 20, ["pic"]), (30, 10, [])]
    assert eng.runner.encoded == [(2, "pic")]
    assert eng.outputs["img"] == reference(prompt, [image("pic", 10, 16)], 2)


def test_a_cached_encoder_output_may_be_split_across_chunks():
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=20)
    first = [*text(1, 10), *[IMG] * 16, 5]
    eng.add(make("first", first, image("pic", 10, 16), max_tokens=1))
    eng.run()
    second = [*text(3, 10), *[IMG] * 16, 6]  # other text: no prefix hit, same image
    eng.add(make("second", second, image("pic", 10, 16), max_tokens=1))
    out, _ = eng.step()
    (item,) = out.scheduled
    assert (item.start_position, len(item.token_ids), item.encoder_inputs) == (0, 20, [])
    eng.run()
    assert eng.runner.encoded == [(2, "pic")]  # by "first" only: reused from the cache
    assert eng.outputs["second"] == reference(second, [image("pic", 10, 16)], 1)


def test_the_encoder_budget_defers_images_to_the_next_step():
    eng = Engine(block_size=4, num_blocks=64, encoder_compute_budget=8)
    eng.add(make("a", [1, *[IMG] * 8, 2], image("a", 1, 8), max_tokens=1))
    eng.add(make("b", [3, *[IMG] * 8, 4], image("b", 1, 8), max_tokens=1))
    out, _ = eng.step()
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 0, 10),
        ("b", 0, 1),  # b stops before its image: the step's encoder budget is spent
    ]
    eng.run()
    assert eng.runner.encoded == [(1, "a"), (2, "b")]
    assert eng.outputs["b"] == reference([3, *[IMG] * 8, 4], [image("b", 1, 8)], 1)


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
    assert events[0].request_id == "C" and events[0].finish_reason is FinishReason.ERROR
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


def test_pooling_requests_finish_after_prefill():
    from mmis.server.protocol.messages import PoolingParams

    eng = Engine(block_size=4, num_blocks=16)
    eng.add(Request("emb", text(1, 9), pooling_params=PoolingParams()))
    out, events = eng.step()
    assert out.scheduled[0].sample and out.scheduled[0].pooling_params is not None
    assert events[0].finished and events[0].new_token_ids == []
    eng.assert_pool_empty()


def test_an_encoder_output_is_released_once_the_request_has_passed_it():
    eng = Engine(block_size=4, num_blocks=64, encoder_cache_size=8)
    eng.add(make("A", [1, *[IMG] * 8, 2], image("a", 1, 8), max_tokens=10))
    eng.step()  # A's prefill consumed a; A keeps decoding
    assert eng.sched.encoder_cache.refs("a") == frozenset()
    eng.add(make("B", [3, *[IMG] * 8, 4], image("b", 1, 8), max_tokens=1))
    out, _ = eng.step()
    item = out.get("B")
    assert item is not None and item.encoder_inputs == [0]  # a was evicted for b
    assert out.freed_encoder_hashes == ["a"] and out.get("A") is not None
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
