"""Typed errors of the shared-memory object store.

Invariants:
- Every error is an :class:`~mmis.protocol.errors.MMISError`, so it maps to a wire
  ``RequestError`` without loss.
- Descriptor problems (:class:`ShmHandleError`) are split by cause: a descriptor whose
  signature does not match (forged or tampered), one whose space was reclaimed or
  force-expired (stale), and one naming a segment the reader does not know.
- :class:`ShmStoreFullError` (and its subclass :class:`ShmPayloadTooLargeError`) is the
  signal for the writer's caller to send the payload inline instead; it never means data
  was lost.
"""

from __future__ import annotations

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode


class ShmError(MMISError):
    """Base class of every shared-memory store error."""


class ShmHandleError(ShmError):
    """An address descriptor that this reader must not dereference."""

    code = ErrorCode.INVALID_REQUEST.value


class ForgedHandleError(ShmHandleError):
    """The descriptor's signature does not authenticate its fields (forged or tampered)."""


class StaleHandleError(ShmHandleError):
    """The descriptor was genuine, but its space has since been reclaimed or force-expired.

    Retryable: the sender can resend the payload inline.
    """

    retryable = True


class UnknownSegmentError(ShmHandleError):
    """The descriptor names a segment that does not exist or that this reader does not serve."""


class ShmStoreFullError(ShmError):
    """No space could be found within the bounded wait; send the payload inline instead."""


class ShmPayloadTooLargeError(ShmStoreFullError):
    """The payload is larger than the whole store; it can never fit, send it inline."""


class ShmPayloadError(ShmError):
    """The payload cannot be stored (not a mapping of numeric arrays) or read back (corrupt)."""

    code = ErrorCode.INVALID_REQUEST.value


class ShmSegmentError(ShmError):
    """The segment file or its key file is missing, malformed or unsafe (bad permissions)."""
