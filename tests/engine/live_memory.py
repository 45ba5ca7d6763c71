"""A :class:`~mmis.engine.execution.device_memory.DeviceMemory` for CPU tests that measures:
the peak of the bytes held by the tensors an operation creates while ``run`` runs (a
``TorchDispatchMode`` sees every op's output; each new storage counts until it is freed).
A CPU has no allocator statistics, but KV sizing's worst-case parts are real allocations
of torch ops, so their bytes show here as they would in CUDA's ``max_memory_allocated``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.held: dict[int, int] = {}  # storage data_ptr -> bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.held:
                continue
            self.held[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.held.pop(key, 0)


class LiveMemory:
    """``used`` and ``total`` as given; every ``peak_of`` measured (and kept in ``peaks``)."""

    def __init__(self, used: int, total: int) -> None:
        self.used, self.total = used, total
        self.peaks: list[int] = []

    def peak_of(self, run: Callable[[], object]) -> int:
        mode = _LiveBytes()
        with mode:
            run()
        self.peaks.append(mode.peak)
        return mode.peak

    def used_and_total(self) -> tuple[int, int]:
        return self.used, self.total
