"""The receiver-side step (P1) that resolves SHM descriptors in a request's features.

Invariants:
- Every :class:`ShmAddress` in the request is acknowledged exactly once per occurrence, even
  when its payload is not needed (the receiver cache already holds ``mm_hash``), so the
  writer's reference count balances and the space is reclaimed.
- Items with ``data=None`` (a shadow hit, or a payload stripped because a prefix-cache hit
  covers its placeholder) are passed through untouched: no descriptor, nothing to ack.
- Inline tensor dicts are passed through untouched.
- The payload is copied out of shared memory *before* the ack, so the returned arrays never
  alias space the writer may reuse.
- Problems are collected over the whole request, never raised half-way: every valid
  descriptor is still acknowledged, then a forged/unknown descriptor raises its
  :class:`ShmHandleError`, else stale ones raise one retryable
  :class:`MultiModalCacheMissError` naming all their hashes (P0 resends inline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import numpy.typing as npt

from mmis.protocol.errors import MultiModalCacheMissError
from mmis.protocol.messages import MultiModalFeature, ShmAddress
from mmis.shm.errors import ShmHandleError, StaleHandleError


class DescriptorReader(Protocol):
    def read(self, address: ShmAddress, *, copy: bool = ...) -> dict[str, npt.NDArray[Any]]: ...

    def ack(self, address: ShmAddress) -> bool: ...


def _never_held(mm_hash: str) -> bool:
    return False


def receive_features(
    reader: DescriptorReader,
    features: Sequence[MultiModalFeature],
    *,
    held: Callable[[str], bool] = _never_held,
) -> list[MultiModalFeature]:
    """Return ``features`` with each SHM descriptor replaced by its arrays, all acked.

    ``held(mm_hash)`` says the receiver cache already has the item: its descriptor is then
    acknowledged without reading and the feature comes back with ``data=None``.
    """
    out: list[MultiModalFeature] = []
    missing: list[str] = []
    failure: ShmHandleError | None = None
    for feature in features:
        address = feature.data
        if not isinstance(address, ShmAddress):
            out.append(feature)
            continue
        try:
            if held(feature.mm_hash):
                reader.ack(address)
                out.append(msgspec.structs.replace(feature, data=None))
                continue
            arrays = reader.read(address, copy=True)
            reader.ack(address)
        except StaleHandleError:
            missing.append(feature.mm_hash)
            out.append(msgspec.structs.replace(feature, data=None))
            continue
        except ShmHandleError as exc:
            failure = failure or exc
            out.append(feature)
            continue
        out.append(msgspec.structs.replace(feature, data=arrays))
    if failure is not None:
        raise failure
    if missing:
        raise MultiModalCacheMissError(missing)
    return out
