"""P1's batch limits when the user leaves them unset: ``--max-num-seqs`` (sequences running at
once) and ``--max-num-batched-tokens`` (tokens computed in one step). No torch here.

Invariants:
- A value the user gives (flag, ``MMIS_ENGINE_*``, the operator's ``spec.engine``) is used as
  is.
- On CPU: :data:`FIXED_MAX_NUM_SEQS` sequences and :data:`CPU_MAX_NUM_BATCHED_TOKENS` tokens.
  A CPU step takes time in proportion to its tokens, and at 512 rows its matmuls already run
  near the CPU's peak, so a smaller step costs little throughput and lets each prompt of a
  burst reach its first token after fewer of the other prompts' tokens (measured on three
  CPUs: ``benchmarks/README.md``, "A smaller CPU step").
- On CUDA when a flag fixes the KV pool's size (no profiling step runs):
  :data:`FIXED_MAX_NUM_SEQS` sequences and :data:`FIXED_MAX_NUM_BATCHED_TOKENS` tokens.
- On CUDA with the KV cache sized from memory (``--gpu-memory-utilization``, the default there:
  ``engine/execution/kv_sizing.py``), both come from the profile:
  a step's tokens are the largest of :data:`STEP_TOKEN_CHOICES` whose profiling step's
  activation peak takes at most 1/:data:`ACTIVATION_SHARE` of the memory the KV cache and the
  activations share (the last choice whatever it takes); running sequences are the pool's
  usable tokens / :data:`TOKENS_PER_SEQ`, within [:data:`FIXED_MAX_NUM_SEQS`,
  :data:`MAX_AUTO_SEQS`] (the upper bound is the largest decode batch CUDA graphs capture,
  ``engine/execution/decode_graphs.py``).
- Under tensor parallelism every rank takes the same decision: the minimum over the ranks
  (``engine/execution/tensor_parallel.py``).
"""

from __future__ import annotations

import dataclasses

FIXED_MAX_NUM_SEQS = 64
FIXED_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_BATCHED_TOKENS = 512
STEP_TOKEN_CHOICES = (8192, 4096, FIXED_MAX_NUM_BATCHED_TOKENS)  # tried largest first
ACTIVATION_SHARE = 8  # a step's activations may take 1/8 of what KV and activations share
TOKENS_PER_SEQ = 256  # KV tokens per running sequence the auto limit plans for
MAX_AUTO_SEQS = 256


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """The scheduler's two limits and where each came from ("set", "default", "profile")."""

    max_num_seqs: int
    max_num_batched_tokens: int
    seqs_source: str = "default"
    tokens_source: str = "default"

    def describe(self) -> str:
        return (
            f"at most {self.max_num_seqs} sequences ({self.seqs_source}) and "
            f"{self.max_num_batched_tokens} tokens a step ({self.tokens_source})"
        )


def step_token_choices(given: int | None) -> tuple[int, ...]:
    """The step sizes a profile tries, largest first: the user's alone when given."""
    return STEP_TOKEN_CHOICES if given is None else (given,)


def step_fits(peak_bytes: int, room_bytes: int) -> bool:
    """Whether a step whose activations peak at ``peak_bytes`` leaves the KV cache enough of
    the ``room_bytes`` both share."""
    return peak_bytes * ACTIVATION_SHARE <= room_bytes


def seqs_for_pool(num_blocks: int, block_size: int) -> int:
    """Running sequences a pool of ``num_blocks`` (block 0 included) plans for."""
    tokens = max(num_blocks - 1, 0) * block_size
    return max(FIXED_MAX_NUM_SEQS, min(MAX_AUTO_SEQS, tokens // TOKENS_PER_SEQ))


def resolve(
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    *,
    profiled_tokens: int | None = None,
    pool_blocks: int | None = None,
    block_size: int = 16,
    on_cpu: bool = False,
) -> BatchLimits:
    """The limits: the user's where given, else the profile's (``profiled_tokens``, the step
    size the KV sizing profile settled on, and ``pool_blocks``, the pool it sized: both
    ``None`` when no profile ran), else the fixed defaults (``on_cpu``: the CPU's step)."""
    if max_num_seqs is not None:
        seqs, seqs_source = max_num_seqs, "set"
    elif pool_blocks is not None:
        seqs, seqs_source = seqs_for_pool(pool_blocks, block_size), "profile"
    else:
        seqs, seqs_source = FIXED_MAX_NUM_SEQS, "default"
    if max_num_batched_tokens is not None:
        tokens, tokens_source = max_num_batched_tokens, "set"
    elif profiled_tokens is not None:
        tokens, tokens_source = profiled_tokens, "profile"
    else:
        tokens = CPU_MAX_NUM_BATCHED_TOKENS if on_cpu else FIXED_MAX_NUM_BATCHED_TOKENS
        tokens_source = "default"
    return BatchLimits(seqs, tokens, seqs_source, tokens_source)
