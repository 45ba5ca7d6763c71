"""Scheduler: continuous batching and the per-step token budget.

Requests join and leave the running batch while others decode, long prompts are prefilled in
contiguous chunks that never exceed ``max_num_batched_tokens``, and ``max_num_seqs`` bounds
the running set. Outputs are compared with the reference of ``sched_harness``; the other
scheduler concepts live in ``test_sched_*.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import Engine, make, reference, text

from mmis.protocol.messages import FinishReason


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
    ended = [e.request_id for e in events if e.finish_reason is not None]
    assert ended == ["B"]  # B leaves after 3 tokens
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
