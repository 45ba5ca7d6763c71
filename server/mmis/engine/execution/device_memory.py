"""What KV sizing reads of a device's memory, and one rank's reading of a profiling step
(used by ``engine/execution/kv_sizing.py`` on rank 0 and ``engine/execution/tensor_parallel.py`` on
the others).

Invariants:
- :func:`rank_fit` is the one rule every rank applies to its own device: the KV cache and a
  step's activations share ``total * fraction - used - reserved`` (``reserved``: memory
  that will be held while serving but is not allocated at sizing time, the CUDA graph pool:
  ``kv_sizing.py``); the step fits when its activations take at most their share of that
  (``batch_limits.step_fits``); the blocks are what is left after the peak. Ranks then agree
  on the minimum of both.
- :class:`CudaMemory` reads torch's caching allocator; a peak counts only what the step
  allocates beyond what was allocated before it (its own KV pool excluded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from mmis.engine.batch_limits import step_fits


class DeviceMemory(Protocol):
    """What KV sizing reads of a device's memory (:class:`CudaMemory`)."""

    def peak_of(self, run: Callable[[], object]) -> int:
        """Bytes ``run`` allocates at its peak beyond what was allocated before it."""
        ...

    def used_and_total(self) -> tuple[int, int]:
        """Bytes in use on the device (weights, context, other processes) and its total."""
        ...


class CudaMemory:
    """A CUDA device's memory, through torch's caching allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peak_of(self, run: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        return int(max(peak, 0))

    def used_and_total(self) -> tuple[int, int]:
        torch.cuda.empty_cache()  # the profiling step's blocks go back to the device
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free), int(total)


@dataclasses.dataclass(frozen=True)
class RankFit:
    """One rank's reading of one profiling step (the same rule on every rank)."""

    fits: bool  # the step's activations leave the KV cache its share (batch_limits.step_fits)
    blocks: int  # KV blocks the rest holds
    used: int
    total: int
    peak: int


def rank_fit(
    memory: DeviceMemory,
    peak: int,
    fraction: float,
    bytes_per_block: int,
    *,
    last: bool,
    reserved: int = 0,
) -> RankFit:
    """This rank's :class:`RankFit` after a profiling step that peaked at ``peak`` bytes
    (``last``: the smallest step size, taken whatever it needs; ``reserved``: bytes held
    aside for what is allocated after sizing)."""
    used, total = memory.used_and_total()
    # what the KV cache and a step's activations share
    room = int(total * fraction) - used - reserved
    blocks = max(room - peak, 0) // bytes_per_block
    return RankFit(last or step_fits(peak, room), blocks, used, total, peak)
