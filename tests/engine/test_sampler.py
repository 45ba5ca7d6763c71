"""The sampler alone (unit), then seeded sampling through the real runner."""

from __future__ import annotations

import pytest
import torch

from mmis.engine.execution.sampler import Sampler, SamplingParamsError, seed_for
from mmis.engine.scheduling.sched_output import is_plain
from mmis.protocol.messages import PoolingParams, SamplingParams

VOCAB = 6
LOGITS = torch.tensor([[0.5, 2.0, 1.0, -1.0, 1.5, 0.0]])  # order: 1, 4, 2, 0, 5, 3


def _draw(params: SamplingParams, rows: int = 4000) -> torch.Tensor:
    logits = LOGITS.expand(rows, VOCAB).clone()
    return Sampler()(logits, [params] * rows, list(range(rows)))


def test_greedy_is_argmax_per_row_in_a_mixed_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [None, SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    params += [SamplingParams(temperature=0.0, top_k=5), None]
    out = Sampler()(logits, params, [0] * 5)
    for row in (0, 1, 3, 4):
        assert out[row] == logits[row].argmax()


def test_unfiltered_sampling_follows_the_softmax():
    counts = torch.bincount(_draw(SamplingParams(temperature=1.0, seed=11)), minlength=VOCAB)
    expected = torch.softmax(LOGITS[0], dim=-1) * counts.sum()
    # every token shows up about as often as its probability says (loose 4-sigma bound)
    assert torch.all((counts - expected).abs() <= 4 * expected.sqrt() + 1)


def test_temperature_sharpens_and_flattens():
    cold = torch.bincount(_draw(SamplingParams(temperature=0.2, seed=1)), minlength=VOCAB)
    hot = torch.bincount(_draw(SamplingParams(temperature=5.0, seed=1)), minlength=VOCAB)
    assert cold[1] > hot[1]
    assert (hot > 0).all()


def test_top_k_keeps_only_the_k_best():
    seen = set(_draw(SamplingParams(temperature=1.0, top_k=2, seed=5)).tolist())
    assert seen == {1, 4}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.softmax(LOGITS[0], dim=-1)  # 1: .43, 4: .26, 2: .16, ...
    top_p = float(probs[1] + probs[4]) - 0.01  # needs tokens 1 and 4, not 2
    seen = set(_draw(SamplingParams(temperature=1.0, top_p=top_p, seed=5)).tolist())
    assert seen == {1, 4}
    only_best = set(_draw(SamplingParams(temperature=1.0, top_p=0.05, seed=5)).tolist())
    assert only_best == {1}


def test_seed_and_position_fix_the_token_whatever_the_batch():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler()(logits, [seeded], [7])
    crowd_logits = torch.cat([torch.randn(3, 100), logits, torch.randn(2, 100)])
    crowd = [SamplingParams(temperature=1.0)] * 3 + [seeded] + [SamplingParams(seed=1)] * 2
    in_crowd = Sampler()(crowd_logits, crowd, [7, 7, 7, 7, 3, 9])
    assert in_crowd[3] == alone[0]
    # the seed matters: across many positions two seeds disagree somewhere
    flat = logits.expand(64, 100)
    a = Sampler()(flat, [SamplingParams(seed=1)] * 64, list(range(64)))
    b = Sampler()(flat, [SamplingParams(seed=2)] * 64, list(range(64)))
    assert not torch.equal(a, b)
    assert seed_for(1, 5) != seed_for(1, 6)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
    ],
)
def test_bad_params_raise_typed_errors(params, message):
    with pytest.raises(SamplingParamsError, match=message) as info:
        Sampler()(LOGITS, [params], [0])
    assert info.value.to_wire().code == "invalid_request"


def test_shape_mismatch_is_a_typed_error():
    with pytest.raises(SamplingParamsError, match="do not match"):
        Sampler()(LOGITS, [None, None], [0, 1])


@pytest.mark.model
def test_seeded_sampling_through_the_runner_is_reproducible(family, driver_cls):
    images = [family.image(5)]
    ids, items, _ = family.request("Describe this image.", images)

    def run(seed: int, with_neighbour: bool, chunk: int) -> list[int]:
        driver = driver_cls(family.runner())
        params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed)
        driver.add("s", ids, items, max_tokens=12, sampling=params, chunk=chunk)
        if with_neighbour:
            other = SamplingParams(temperature=1.3)
            driver.add("n", ids[:-3], items, max_tokens=12, sampling=other, join_step=1)
        return driver.run()["s"]

    first = run(7, with_neighbour=False, chunk=10_000)
    assert run(7, with_neighbour=True, chunk=9) == first  # batch and chunking do not matter
    assert run(8, with_neighbour=False, chunk=10_000) != first
    assert first != family.reference("Describe this image.", images, 12)  # really sampled


def test_plain_rows_sample_as_checked_rows():
    """``plain=True`` (every row ``is_plain``, decided once per request) skips the per-row
    checks, never the result: greedy and seeded rows pick the same tokens either way."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=1.0, top_k=4, seed=9),
        SamplingParams(temperature=0.9, top_p=0.5, seed=2),
    ]
    for params in ([rows[0]] * 6, rows + rows[:2]):
        assert all(is_plain(p, None) for p in params)
        positions = list(range(len(params)))
        checked = Sampler()(logits, params, positions)
        plain = Sampler()(logits, params, positions, plain=True)
        assert torch.equal(checked, plain)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(min_p=0.1),
        SamplingParams(logit_bias={1: 2.0}),
        SamplingParams(logprobs=2),
        SamplingParams(prompt_logprobs=0),
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
        SamplingParams(top_k=-2),
        None,
    ],
)
def test_rows_that_need_checks_or_extras_are_not_plain(params):
    assert not is_plain(params, None)


def test_a_pooling_request_is_not_plain():
    assert not is_plain(SamplingParams(), PoolingParams())
