"""The batch limits ``mmis engine`` picks when left unset (``engine/batch_limits.py``):
the
user's values kept, the fixed defaults without a profile, the profile's step size and the
pool's sequences with one. No torch: the profile's readings are the inputs."""

from __future__ import annotations

from mmis.engine.batch_limits import (
    ACTIVATION_SHARE,
    CPU_MAX_NUM_BATCHED_TOKENS,
    FIXED_MAX_NUM_BATCHED_TOKENS,
    FIXED_MAX_NUM_SEQS,
    MAX_AUTO_SEQS,
    TOKENS_PER_SEQ,
    resolve,
    seqs_for_pool,
    step_fits,
    step_token_choices,
)
from mmis.engine.config import EngineConfig
from mmis.engine.scheduling.sched_config import SchedulerConfig


def test_given_limits_are_kept_whatever_the_profile_says() -> None:
    limits = resolve(7, 300, profiled_tokens=8192, pool_blocks=100_000, block_size=16)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (7, 300)
    assert (limits.seqs_source, limits.tokens_source) == ("set", "set")
    assert limits.describe() == "at most 7 sequences (set) and 300 tokens a step (set)"


def test_without_a_profile_the_fixed_defaults_apply() -> None:
    cfg = EngineConfig()
    assert cfg.max_num_seqs is None and cfg.max_num_batched_tokens is None
    limits = resolve(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (64, 2048)
    assert (limits.seqs_source, limits.tokens_source) == ("default", "default")
    scheduler = SchedulerConfig()  # the scheduler's own defaults are the same two
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (
        FIXED_MAX_NUM_SEQS,
        FIXED_MAX_NUM_BATCHED_TOKENS,
    )


def test_on_cpu_the_default_step_is_smaller_and_a_given_one_is_kept() -> None:
    limits = resolve(None, None, on_cpu=True)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (64, 512)
    assert CPU_MAX_NUM_BATCHED_TOKENS == 512 < FIXED_MAX_NUM_BATCHED_TOKENS
    assert limits.describe() == "at most 64 sequences (default) and 512 tokens a step (default)"
    given = resolve(None, 4096, on_cpu=True)
    assert (given.max_num_batched_tokens, given.tokens_source) == (4096, "set")


def test_a_profile_sets_the_step_size_and_sequences_from_the_pool() -> None:
    blocks = 1 + 100 * TOKENS_PER_SEQ // 16  # the pool holds 100 sequences' planned tokens
    limits = resolve(None, None, profiled_tokens=4096, pool_blocks=blocks, block_size=16)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (100, 4096)
    assert (limits.seqs_source, limits.tokens_source) == ("profile", "profile")
    only_seqs_given = resolve(12, None, profiled_tokens=8192, pool_blocks=blocks, block_size=16)
    assert (only_seqs_given.max_num_seqs, only_seqs_given.max_num_batched_tokens) == (12, 8192)


def test_sequences_from_the_pool_stay_within_bounds() -> None:
    assert seqs_for_pool(2, 16) == FIXED_MAX_NUM_SEQS  # a small pool: never below the default
    assert seqs_for_pool(10_000_000, 16) == MAX_AUTO_SEQS  # the largest graph-captured batch
    assert seqs_for_pool(1 + 150 * TOKENS_PER_SEQ // 16, 16) == 150
    assert seqs_for_pool(1 + 150 * TOKENS_PER_SEQ // 256, 256) == 150  # counts tokens, not blocks


def test_step_sizes_largest_first_and_the_activation_share() -> None:
    assert step_token_choices(None) == (8192, 4096, 2048)
    assert step_token_choices(512) == (512,)
    room = 80 * ACTIVATION_SHARE
    assert step_fits(80, room)
    assert not step_fits(81, room)
