"""Scheduler: requests that cannot run, and aborts.

A request that can never fit the KV pool is rejected with a non-retryable error while others
continue; one that outgrows the pool stops instead of looping; aborts free every block and
encoder slot; malformed requests raise typed errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import IMG, Engine, image, make, reference, text

from mmis.engine.scheduling.request import InvalidRequestError, Request
from mmis.engine.scheduling.sched_config import SchedulerConfig
from mmis.engine.scheduling.scheduler import Scheduler
from mmis.protocol.messages import ErrorCode, FinishReason


def test_a_request_that_can_never_fit_is_rejected_and_others_continue():
    eng = Engine(block_size=4, num_blocks=5)  # 16 token slots in all
    eng.add(make("huge", text(1, 20)), make("ok", text(2, 6), max_tokens=4))
    out, events = eng.step()
    assert [s.request_id for s in out.scheduled] == ["ok"]
    (ev,) = events[:1]
    assert ev.request_id == "huge" and ev.finish_reason == FinishReason.ERROR
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
    assert eng.finished["grow"].finish_reason == FinishReason.LENGTH
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
