"""The start-up self-check: one prompt through the engine's own path (scheduler, runner, paged
attention, the model adapter, prompt logprobs) against the plain transformers forward of the
same prompt. The adapters reach into transformers' modules (``engine/execution/model/``,
``engine/execution/paged_attention.py``); a transformers release that changes those internals then
fails at start-up, naming the gap, instead of serving wrong tokens.

Invariants:
- It runs on the runner the serving core will use, before that core exists, with a scheduler
  of its own; it leaves nothing behind: its one request finishes (its KV blocks freed), and a
  prompt-logprobs request never reads or writes the prefix cache (``engine/scheduling/request.py``).
- Text only, so it needs no image processor (the image path is held to transformers by
  ``tests/engine/test_engine_parity.py``); the prompt spans several prefill chunks, so the
  paged read of already-computed context is part of what is compared.
- It checks the attention backend the runner chose (``attn_backends.py``); a failure on a
  flash backend switches the runner to ``TorchBackend`` (logged, with the failure) and checks
  again, so the serving core starts on a backend that passed, or not at all.
- What is compared: the log-probability of every next prompt token (rows 1..n-1), the
  engine's against ``log_softmax`` of the plain forward's logits in the model's dtype; the
  tolerance is :data:`TOLERANCE` for the dtype (float32: kernel-order noise only).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mmis.engine.core import EngineCore
from mmis.engine.execution.attn_backends import TorchBackend
from mmis.engine.execution.runner import ModelRunner
from mmis.engine.scheduling.sched_config import SchedulerConfig
from mmis.engine.scheduling.scheduler import Scheduler
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import EngineCoreRequest, ErrorCode, SamplingParams

log = logging.getLogger(__name__)

PROMPT_TOKENS = 40
CHUNK = 16  # prefill chunk of the check: the prompt crosses two chunk boundaries
# max |engine - transformers| of a token's log-probability, by the model's dtype
TOLERANCE = {torch.float32: 2e-3, torch.float16: 0.1, torch.bfloat16: 0.2}


class SelfCheckError(MMISError, RuntimeError):
    """The engine's forward does not match transformers' for this model; not retryable."""

    code = ErrorCode.INTERNAL.value


def _special_ids(model: Any) -> set[int]:
    """Every token id the model's configs name (image, video, BOS/EOS/pad, ...)."""
    ids: set[int] = set()
    for config in (model.config, model.config.get_text_config()):
        for key, value in vars(config).items():
            if "token_id" in key or "token_index" in key:
                for v in value if isinstance(value, list | tuple) else [value]:
                    if isinstance(v, int):
                        ids.add(v)
    return ids


def check_prompt(model: Any, vocab_size: int) -> list[int]:
    """A fixed text prompt of :data:`PROMPT_TOKENS` ids, none of them special."""
    special = _special_ids(model)
    ids: list[int] = []
    k = 0
    while len(ids) < PROMPT_TOKENS:
        token = (37 * k + 11) % vocab_size
        k += 1
        if token not in special and token >= 3:
            ids.append(token)
    return ids


def run_self_check(runner: ModelRunner) -> float:
    """Serve :func:`check_prompt` through the engine and compare with transformers; returns
    the largest difference, raises :class:`SelfCheckError` over :data:`TOLERANCE`. A failure
    on a flash backend (``attn_backends.py``) switches the runner to :class:`TorchBackend`,
    logged with the reason, and checks again (not under tensor parallelism)."""
    adapter = runner.adapter
    ids = check_prompt(adapter.model, adapter.vocab_size)
    need = -(-(len(ids) + 1) // runner.block_size)
    if runner.pool.num_blocks < need:
        raise SelfCheckError(
            f"the self-check needs {need} KV blocks; the pool has {runner.pool.num_blocks}"
        )
    try:
        return _check(runner, ids)
    except SelfCheckError as exc:
        if isinstance(runner.backend, TorchBackend) or runner.tensor_parallel is not None:
            raise
        log.warning(
            "self-check failed on attention backend %s (%s); switching to torch SDPA and "
            "checking again",
            runner.backend.name,
            exc,
        )
        runner.backend = TorchBackend()
        return _check(runner, ids)


def _check(runner: ModelRunner, ids: list[int]) -> float:
    adapter = runner.adapter
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=CHUNK,
            num_blocks=runner.pool.num_blocks,
            block_size=runner.block_size,
            enable_prefix_caching=False,
        )
    )
    core = EngineCore(scheduler, runner)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    core.add_request(EngineCoreRequest("mmis-self-check", ids, [], params))
    got = None
    with torch.inference_mode():
        for _ in range(4 * PROMPT_TOKENS // CHUNK + 4):
            for out in core.step():
                if out.error is not None:
                    raise SelfCheckError(f"the self-check request failed: {out.error.message}")
                got = out.prompt_logprobs if out.prompt_logprobs is not None else got
            if not core.has_work():
                break
        if runner.tensor_parallel is not None:  # the other ranks run the same forward
            runner.tensor_parallel.broadcast_plain(ids)
        reference = adapter.reference_logits(ids)
    if got is None or len(got.logprobs) != len(ids):
        raise SelfCheckError("the self-check request returned no prompt logprobs")
    want = torch.log_softmax(reference[0, :-1].float(), dim=-1)
    want = want.gather(1, torch.tensor(ids[1:], device=want.device).view(-1, 1)).view(-1).cpu()
    values = torch.tensor([row[0] for row in got.logprobs[1:]])
    worst = float((values - want).abs().max())
    tolerance = TOLERANCE.get(adapter.dtype, 0.2)
    if not worst <= tolerance:  # NaN fails too
        raise SelfCheckError(
            f"the engine's forward differs from transformers' for this model (a prompt "
            f"token's log-probability off by {worst:.3g}, tolerance {tolerance:g} in "
            f"{str(adapter.dtype).removeprefix('torch.')}): the installed transformers "
            "may have changed module internals the adapters rely on (engine/execution/model/)"
        )
    log.info("self-check passed: prompt log-probabilities within %.2g of transformers", worst)
    return worst
