"""Scheduler: preemption by recompute.

When the KV pool runs out, the latest arrival is preempted, goes back to the front of the
waiting queue (before requests that never started) and later completes with the same tokens
as without preemption.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import Engine, make, reference, text


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
