"""The exact byte size of one multimodal item, as both caches account it.

Invariants:
- P0's shadow (metadata only) and P1's receiver (real tensors) charge an item the *same*
  number of bytes because both call :func:`item_nbytes` on the same processor output: the
  sum of every tensor's ``nbytes`` plus :data:`TENSOR_OVERHEAD_BYTES` per tensor.
- The size depends only on the tensors' dtypes and shapes, never on their values, the dict's
  key order or where the tensors live (numpy or torch, anything exposing ``nbytes``).
- A value that is not a tensor raises :class:`ItemSizeError` instead of being guessed at.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode

TENSOR_OVERHEAD_BYTES: Final = 64
"""Fixed charge per tensor (header, bookkeeping): makes empty tensors cost something."""


class ItemSizeError(MMISError, TypeError):
    """An item whose tensors cannot be sized (a value without an integer ``nbytes``)."""

    code = ErrorCode.INVALID_REQUEST.value


def tensor_nbytes(name: str, tensor: Any) -> int:
    """Bytes charged for one tensor: its ``nbytes`` plus the fixed overhead."""
    nbytes = getattr(tensor, "nbytes", None)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ItemSizeError(
            f"multimodal tensor {name!r} has type {type(tensor).__name__}, which does not "
            "expose a non-negative integer nbytes; items must map names to arrays"
        )
    return nbytes + TENSOR_OVERHEAD_BYTES


def item_nbytes(tensors: Mapping[str, Any]) -> int:
    """Bytes charged for one item: the sum of :func:`tensor_nbytes` over its tensors."""
    if not isinstance(tensors, Mapping):
        raise ItemSizeError(
            f"a multimodal item must be a mapping of tensor name to array, "
            f"got {type(tensors).__name__}"
        )
    return sum(tensor_nbytes(str(name), tensor) for name, tensor in tensors.items())
