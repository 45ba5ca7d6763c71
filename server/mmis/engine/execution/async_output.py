"""A step's sampled token ids on their way to the host, without stopping the device.

:meth:`SampledCopies.start` is called by the runner right after sampling (``runner.py``
``launch``); :meth:`SampledCopy.tolist` by its ``collect``, usually after the next step was
launched (async scheduling, ``engine/core.py``).

Invariants:
- On CUDA the copy runs on a separate copy stream that first waits for the compute stream's
  work so far (the sampling), into one of two pinned host buffers used in turn; an event
  recorded after it is the only thing :meth:`SampledCopy.tolist` waits for. The compute
  stream never waits for the copy, so the next step's forward is queued behind the sampling
  alone. A buffer is refilled only after its previous copy's event completed (always so when
  each launched step is collected before the launch after next, as the core does).
- The sampled device tensor stays valid for the copy (``record_stream``), and the runner keeps
  it as the previous step's sampled ids, which the next step reads on the device.
- Elsewhere (CPU) the same calls run with no stream and no buffer: the ids are already in
  host memory, :meth:`SampledCopy.tolist` reads them.
"""

from __future__ import annotations

import torch

__all__ = ["SampledCopies", "SampledCopy"]


class SampledCopy:
    """One step's sampled ids: :meth:`tolist` waits for their copy (if any) and reads them."""

    __slots__ = ("_event", "_host")

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        self._host = host
        self._event = event

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        ids: list[int] = self._host.tolist()
        return ids


class SampledCopies:
    """The runner's copy stream and pinned buffers (CUDA), or the synchronous stand-in."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def start(self, sampled: torch.Tensor) -> SampledCopy:
        """Begin moving ``sampled`` (1-D int64, on the device) to the host."""
        if sampled.device.type != "cuda":
            return SampledCopy(sampled)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=sampled.device)
        stream = self._stream
        turn, self._turn = self._turn, self._turn ^ 1
        event, buffer = self._events[turn], self._buffers[turn]
        if event is not None:
            event.synchronize()  # collected long since in the core's order: no wait
        count = int(sampled.shape[0])
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(max(count, 256), dtype=torch.long, pin_memory=True)
            self._buffers[turn] = buffer
        host = buffer[:count]
        stream.wait_stream(torch.cuda.current_stream(sampled.device))
        with torch.cuda.stream(stream):
            host.copy_(sampled, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        sampled.record_stream(stream)
        self._events[turn] = event
        return SampledCopy(host, event)
