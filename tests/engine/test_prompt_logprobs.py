"""Prompt logprobs (``SamplingParams.prompt_logprobs``) through the real scheduler, runner and
core, against a plain transformers forward's ``log_softmax`` over the same prompt.

The prompt carries an image (rows inside its placeholder span are scored too) and crosses
several prefill chunks (a small ``max_num_batched_tokens``: a chunk's last row scores the
next chunk's first token); the same prompt is served once before without prompt logprobs,
so its prefix is in the prefix cache, which a prompt-logprobs request must not use.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mmis.engine.core import EngineCore
from mmis.engine.scheduling.sched_config import SchedulerConfig
from mmis.engine.scheduling.scheduler import Scheduler
from mmis.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
    TokenLogprobs,
)

K = 2
CHUNK = 24  # max_num_batched_tokens: the prompt spans several chunks


def _core(family: Any) -> EngineCore:
    runner = family.runner(num_blocks=128)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=CHUNK,
            num_blocks=runner.pool.num_blocks,
            block_size=runner.block_size,
            enable_prefix_caching=True,
            encoder_cache_size=4096,
            encoder_compute_budget=4096,
        )
    )
    return EngineCore(scheduler, runner)


def _serve(
    core: EngineCore, request_id: str, family: Any, params: SamplingParams
) -> tuple[list[int], list[Any], Any, list[EngineCoreOutput]]:
    ids, items, inputs = family.request(
        "Describe this image in a few short words, please.", [family.image(3)]
    )
    features = [
        MultiModalFeature(
            modality="image",
            mm_hash=item.mm_hash,
            placeholder=PlaceholderRange(item.offset, item.length),
            data={k: np.asarray(v) for k, v in dict(item.data).items()},
        )
        for item in items
    ]
    core.add_request(EngineCoreRequest(request_id, ids, features, params))
    outs: list[EngineCoreOutput] = []
    for _ in range(200):
        outs += [o for o in core.step() if o.request_id == request_id]
        if outs and outs[-1].finish_reason is not None:
            break
    assert outs and outs[-1].finish_reason == "length", outs[-1:]
    return ids, items, inputs, outs


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava", "qwen2-vl"], indirect=True)
def test_prompt_logprobs_equal_a_plain_forward_across_chunks_images_and_the_prefix_cache(
    family: Any,
) -> None:
    core = _core(family)
    _serve(core, "warm", family, SamplingParams(max_tokens=1, temperature=0))  # fills the cache
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K)
    ids, items, inputs, outs = _serve(core, "r", family, params)
    assert len(ids) > 2 * CHUNK and items and items[0].offset > 0
    assert outs[0].num_cached_tokens == 0  # the cached prefix was not used
    got = outs[0].prompt_logprobs
    assert isinstance(got, TokenLogprobs)
    assert all(o.prompt_logprobs is None for o in outs[1:])  # the first output only
    assert [row[0] for row in got.token_ids] == ids  # one row per prompt token, in order
    assert got.logprobs[0] == [] and got.ranks[0] == 0  # nothing precedes the first token
    with torch.no_grad():
        reference = torch.log_softmax(family.hf_model(**inputs).logits[0].float(), dim=-1)
    target = torch.tensor(ids[1:])
    want = reference[:-1].gather(1, target.view(-1, 1)).view(-1)
    values = torch.tensor([row[0] for row in got.logprobs[1:]])
    assert torch.allclose(values, want, atol=1e-4), (values - want).abs().max()
    top = reference[:-1].topk(K, dim=-1)
    assert torch.allclose(
        torch.tensor([row[1:] for row in got.logprobs[1:]]), top.values, atol=1e-4
    )
    ranks = (reference[:-1] > want.view(-1, 1)).sum(-1) + 1
    assert got.ranks[1:] == ranks.tolist()
    image = items[0]
    assert image.offset + image.length < len(ids)  # the image span's rows were compared too
    assert core._prompt_rows == {}  # nothing left behind
