"""Runner behaviour beyond parity: the encoder-output store, pooling, typed errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mmis.engine.execution.model import ModelInputError
from mmis.engine.execution.paged_attention import PagedAttentionError
from mmis.engine.execution.step_errors import EncoderOutputMissingError, StepInputError
from mmis.engine.scheduling.sched_output import MultiModalInput, ScheduledRequest, SchedulerOutput
from mmis.protocol.messages import PoolingParams

pytestmark = pytest.mark.model


def _seq(rid, ids, items, table, start=0, **kw):
    return ScheduledRequest(rid, ids[start:], start, table, items, **kw)


def test_encoder_runs_once_for_all_new_items_and_skips_stored(family):
    runner = family.runner()
    ids_a, items_a, _ = family.request("Describe this image.", [family.image(1)])
    ids_b, items_b, _ = family.request("Compare them.", [family.image(1), family.image(2)])
    assert items_a[0].mm_hash == items_b[0].mm_hash  # same image, same hash
    out = runner.execute(
        SchedulerOutput(
            [
                _seq("a", ids_a, items_a, list(range(8))),
                _seq("b", ids_b, items_b, list(range(8, 16))),
            ]
        )
    )
    assert runner.num_encoder_calls == 1  # one encoder call for the whole step
    assert sorted(out.encoded_mm_hashes) == sorted({items_b[0].mm_hash, items_b[1].mm_hash})
    # a later request with a stored image and its tensors attached: no encoder run
    runner.execute(SchedulerOutput([_seq("c", ids_a, items_a, list(range(16, 24)))]))
    assert runner.num_encoder_calls == 1


def test_freed_encoder_output_is_dropped_and_then_missing(family):
    runner = family.runner()
    ids, items, _ = family.request("Describe this image.", [family.image(1)])
    cut = items[0].offset + 2  # the first chunk ends inside the placeholder
    runner.execute(
        SchedulerOutput([ScheduledRequest("a", ids[:cut], 0, list(range(8)), items, sample=False)])
    )
    bare = [dataclasses.replace(it, data=None) for it in items]
    with pytest.raises(EncoderOutputMissingError, match=items[0].mm_hash):
        runner.execute(
            SchedulerOutput(
                [ScheduledRequest("a", ids[cut:], cut, list(range(8)), bare)],
                freed_encoder_hashes=[items[0].mm_hash],
            )
        )
    assert items[0].mm_hash not in runner.encoder_outputs


@pytest.mark.parametrize("pooling_type", ["mean", "last"])
def test_pooling_matches_the_hidden_states_of_transformers(family, driver_cls, pooling_type):
    images = [family.image(4)]
    ids, items, inputs = family.request("Describe this image.", images)
    driver = driver_cls(family.runner(block_size=4))
    driver.add("p", ids, items, chunk=11, pooling=PoolingParams(pooling_type, normalize=True))
    driver.run()
    with torch.inference_mode():
        hidden = family.hf_model.model(**inputs).last_hidden_state[0]
    vector = hidden.mean(dim=0) if pooling_type == "mean" else hidden[-1]
    expected = torch.nn.functional.normalize(vector, dim=-1).numpy()
    got = driver.pooled("p")
    assert got.dtype == np.float32 and got.shape == (family.adapter.hidden_size,)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert driver.runner.extras.partial_sums == {}  # no state left behind


def test_mean_pooling_refuses_a_prefix_hit(family):
    runner = family.runner()
    ids, _, _ = family.request("Hello, how are you today?", [])
    seq = ScheduledRequest("p", ids[16:], 16, [0, 1, 2], pooling_params=PoolingParams("mean"))
    with pytest.raises(StepInputError, match="mean pooling needs every prompt token"):
        runner.execute(SchedulerOutput([seq]))


def test_bad_steps_raise_typed_errors(family):
    runner = family.runner(num_blocks=4, block_size=4)
    for bad in ([family.adapter.vocab_size], [-5], [3, -(2**62)]):  # one check, both ends
        with pytest.raises(StepInputError, match="outside"):
            runner.execute(SchedulerOutput([ScheduledRequest("x", bad, 0, [0])]))
    with pytest.raises(StepInputError, match="twice"):
        seq = ScheduledRequest("x", [1, 2], 0, [0])
        runner.execute(SchedulerOutput([seq, seq]))
    with pytest.raises(PagedAttentionError, match="cannot hold"):
        runner.execute(SchedulerOutput([ScheduledRequest("x", [1] * 5, 0, [0])]))
    ids, items, _ = family.request("Describe this image.", [family.image(1)])
    broken = dataclasses.replace(items[0], data={"pixel_values": np.zeros((1, 3, 5), np.float32)})
    with pytest.raises(ModelInputError) as info:
        runner.execute(
            SchedulerOutput([ScheduledRequest("x", ids[:4], 0, [0], [broken], sample=False)])
        )
    assert info.value.to_wire().code == "invalid_request"


@pytest.mark.parametrize("family", ["qwen2-vl"], indirect=True)  # M-RoPE is Qwen2-VL's
def test_qwen_positions_need_a_grid_for_items_without_tensors(family):
    ids, items, _ = family.request("Describe this image.", [family.image(1)])
    bare = dataclasses.replace(items[0], data=None, grid_thw=None)
    with pytest.raises(ModelInputError, match="grid_thw"):
        family.adapter.positions(0, len(ids), [bare])


def test_item_grid_comes_from_its_tensors_and_survives_dropping_them():
    item = MultiModalInput("h", 3, 4, data={"image_grid_thw": np.array([[1, 4, 4]])})
    assert item.grid_thw == (1, 4, 4)
    assert dataclasses.replace(item, data=None).grid_thw == (1, 4, 4)
    assert MultiModalInput("h", 3, 4, data={"pixel_values": np.zeros(1)}).grid_thw is None
