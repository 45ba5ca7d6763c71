"""The one scheduler output the runner reads: tensors only for this step's encoder runs, the
item grid kept without them, no tensors at all for items a prefix hit covers (S7)."""

from __future__ import annotations

import numpy as np
import pytest

from mmis.engine.scheduling.request import Request
from mmis.engine.scheduling.sched_config import SchedulerConfig
from mmis.engine.scheduling.sched_output import EncoderInputError
from mmis.engine.scheduling.scheduler import Scheduler
from mmis.protocol.messages import (
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
    ShmAddress,
)

IMG = 7


def feature(ident: str, offset: int, length: int, data: object) -> MultiModalFeature:
    return MultiModalFeature(
        modality="image", mm_hash=ident, placeholder=PlaceholderRange(offset, length), data=data
    )  # type: ignore[arg-type]


def pixels(seed: int) -> dict[str, np.ndarray]:
    return {
        "pixel_values": np.full((4, 3), seed, dtype=np.float32),
        "image_grid_thw": np.array([[1, 2, 2]]),
    }


def request(rid: str, prompt: list[int], *features: MultiModalFeature) -> Request:
    return Request(rid, prompt, mm_features=features, sampling_params=SamplingParams(max_tokens=1))


def drain(sched: Scheduler) -> None:
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, [50 for s in out.scheduled if s.sample])


def test_the_output_carries_tensors_only_for_this_steps_encoder_runs():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=9))
    prompt = [1, *[IMG] * 4, 2, 3, *[IMG] * 4, 4]  # items at [1, 5) and [7, 11)
    sched.add_request(
        request("r", prompt, feature("x", 1, 4, pixels(1)), feature("y", 7, 4, pixels(2)))
    )
    out = sched.schedule()
    (seq,) = out.scheduled
    # [0, 9) reaches both items: both encoded now, y's range split at 9
    assert (seq.start_position, list(seq.token_ids)) == (0, prompt[:9])
    assert [(m.mm_hash, m.data is not None) for m in seq.mm_items] == [("x", True), ("y", True)]
    assert seq.encoder_inputs == [0, 1]
    sched.update_from_output(out, [])
    out = sched.schedule()
    (seq,) = out.scheduled
    # both already encoded: no tensors, but their grids still reach the runner (M-RoPE)
    assert [(m.mm_hash, m.data is not None, m.grid_thw) for m in seq.mm_items] == [
        ("x", False, (1, 2, 2)),
        ("y", False, (1, 2, 2)),
    ]
    assert seq.encoder_inputs == []
    assert seq.sample and seq.block_table == sched.kv.block_table("r")


def test_prefix_hit_sends_no_covered_tensors_and_the_request_keeps_its_payloads():
    cfg = SchedulerConfig(block_size=4, num_blocks=32)
    sched = Scheduler(cfg)
    prompt = [1, *[IMG] * 4, 2, *[IMG] * 4, 3, 4, 5, 6, 7]
    shm = ShmAddress("seg", 0, 64, 9, 1, b"sig")
    first = request("first", prompt, feature("x", 1, 4, pixels(1)), feature("s", 6, 4, shm))
    sched.add_request(first)
    drain(sched)
    x_again = feature("x", 1, 4, pixels(1))
    second = request("second", [*prompt, 8], x_again, feature("s", 6, 4, shm))
    sched.add_request(second)
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.start_position == 12 and item.encoder_inputs == []
    x, s = item.mm_items
    assert x.data is None and x.grid_thw == (1, 2, 2)  # pixels dropped, the grid kept
    assert s.data is None  # nothing to encode: the runner gets no payload
    assert second.mm_features[1].data == shm  # the request keeps the descriptor it was sent
    assert second.mm_features[0].data is x_again.data  # the scheduler keeps the full payload


def test_an_encoder_run_without_tensors_is_a_typed_error():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32))
    sched.add_request(request("r", [1, IMG, IMG, 2], feature("x", 1, 2, None)))
    (item,) = sched.schedule().scheduled  # the pass itself never raises; the runner checks
    assert item.encoder_inputs == [0]
    with pytest.raises(EncoderInputError, match="carries no tensors"):
        item.check_encoder_inputs()


def test_preempted_requests_reach_the_runner_as_ended():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=4))  # 3 usable blocks
    for rid, arrival in (("a", 1.0), ("b", 2.0)):
        sched.add_request(
            Request(
                rid,
                [1, 2, 3, 4],
                sampling_params=SamplingParams(max_tokens=8),
                arrival_time=arrival,
            )
        )
    for _ in range(6):
        out = sched.schedule()
        if out.preempted_request_ids:
            break
        sched.update_from_output(out, [50 for s in out.scheduled if s.sample])
    assert out.preempted_request_ids == ["b"]
    assert "b" in out.ended_request_ids


def test_sampled_tokens_that_do_not_match_the_step_are_a_typed_error():
    """``update_from_output`` takes one token per chunk that samples, in order; a count or
    placement that cannot be the runner's is a ``SchedulerError``, never a token given to
    the wrong request."""
    from mmis.engine.scheduling.step_update import SchedulerError
    from mmis.protocol.messages import PoolingParams

    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64))
    sched.add_request(request("a", [1, 2, 3]))
    sched.add_request(Request("emb", [4, 5], pooling_params=PoolingParams()))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "emb"]
    with pytest.raises(SchedulerError, match="did not sample"):
        sched.update_from_output(out, [50, 51])  # a token for the pooling chunk
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64))
    sched.add_request(request("a", [1, 2, 3]))
    sched.add_request(Request("emb", [4, 5], pooling_params=PoolingParams()))
    out = sched.schedule()
    with pytest.raises(SchedulerError, match="sampled fewer"):
        sched.update_from_output(out, [50, 51, 52])
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64))
    sched.add_request(request("a", [1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(SchedulerError, match="no sampled token"):
        sched.update_from_output(out, [])
