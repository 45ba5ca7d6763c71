"""The start-up self-check (``engine/self_check.py``): passes on every tiny family, fails
loudly when the engine's forward drifts from transformers', and runs when the engine starts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mmis.engine.self_check import SelfCheckError, check_prompt, run_self_check


@pytest.mark.model
def test_the_engine_matches_transformers_on_every_family(family: Any) -> None:
    runner = family.runner(num_blocks=32)
    assert run_self_check(runner) <= 2e-3
    assert runner.pool.num_blocks == 32  # the same pool, whole again for the serving core
    special = {family.adapter.model.config.image_token_id, *family.adapter.eos_token_ids}
    assert not special & set(check_prompt(family.adapter.model, family.adapter.vocab_size))


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava"], indirect=True)
def test_a_forward_that_drifts_from_transformers_refuses_to_start(
    family: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a transformers release that changed a module the adapter patches would do: the
    engine's logits no longer equal the plain forward's."""
    runner = family.runner(num_blocks=32)
    plain = type(family.adapter).compute_logits

    def drifted(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        return plain(self, hidden) * 1.05

    monkeypatch.setattr(type(family.adapter), "compute_logits", drifted)
    with pytest.raises(SelfCheckError, match="differs from transformers'") as info:
        run_self_check(runner)
    assert "engine/execution/model/" in str(info.value) and not info.value.retryable
