"""Log-probabilities of sampled tokens (``engine/execution/logprobs.py``): the math against a plain
``log_softmax`` reference, and through the real runner on the tiny LLaVA against the plain
transformers model's own logits."""

from __future__ import annotations

import pytest
import torch

from mmis.engine.execution import logprobs
from mmis.engine.scheduling.sampling_params import SamplingParamsError, validate
from mmis.protocol.messages import SamplingParams


def test_rows_that_ask_get_the_sampled_token_its_rank_and_the_top_k() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(logprobs=3), None, SamplingParams(), SamplingParams(logprobs=0)]
    pending = logprobs.prepare(logits, params)
    assert pending is not None
    reference = torch.log_softmax(logits, dim=-1)
    logits.mul_(0.0)  # the sampler may change the logits in place: the values were taken before
    sampled = torch.tensor([7, 1, 2, int(reference[3].argmax())])
    out = logprobs.finish(pending, sampled)
    assert sorted(out) == [0, 3]  # only the rows that asked
    first = out[0]
    top = reference[0].topk(3)
    assert first.token_ids == [[7, *top.indices.tolist()]]
    assert torch.allclose(
        torch.tensor(first.logprobs[0]), torch.cat([reference[0, 7:8], top.values])
    )
    assert first.ranks == [int((reference[0] > reference[0, 7]).sum()) + 1]
    last = out[3]
    assert last.token_ids == [[int(reference[3].argmax())]] and last.ranks == [1]
    assert abs(last.logprobs[0][0] - float(reference[3].max())) < 1e-6
    assert logprobs.prepare(logits, [None, SamplingParams()]) is None  # nobody asked: free


def test_out_of_range_logprobs_are_refused_naming_the_field() -> None:
    validate(SamplingParams(logprobs=20))
    for bad in (-1, 21):
        try:
            validate(SamplingParams(logprobs=bad))
        except SamplingParamsError as exc:
            assert str(exc).startswith("logprobs")
        else:
            raise AssertionError(f"logprobs={bad} was accepted")


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava"], indirect=True)  # the math is family-independent
def test_runner_logprobs_are_the_models_own(family, driver_cls) -> None:  # type: ignore[no-untyped-def]
    images = [family.image(5)]
    ids, items, inputs = family.request("Describe this image.", images)
    driver = driver_cls(family.runner())
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2)
    driver.add("r", ids, items, max_tokens=3, sampling=params)
    got = driver.run()["r"]
    first = next(o.logprobs["r"] for o in driver.outputs if "r" in o.logprobs)
    with torch.no_grad():
        reference = torch.log_softmax(family.hf_model(**inputs).logits[0, -1].float(), dim=-1)
    top = reference.topk(2)
    assert first.token_ids[0][0] == got[0] == int(top.indices[0])  # greedy: the top token
    assert first.token_ids[0][1:] == top.indices.tolist() and first.ranks == [1]
    assert torch.allclose(torch.tensor(first.logprobs[0][1:]), top.values, atol=1e-4)
    assert sum("r" in o.logprobs for o in driver.outputs) == len(got)  # one per sampled token
