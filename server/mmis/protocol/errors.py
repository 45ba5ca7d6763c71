"""Typed exceptions shared by P0 and P1.

Invariant: an exception that a client can heal by resending carries ``retryable = True``;
every exception here can be turned into a wire :class:`RequestError` without loss.
"""

from __future__ import annotations

from collections.abc import Iterable

from mmis.protocol.messages import ErrorCode, RequestError


class MMISError(Exception):
    code: str = ErrorCode.INTERNAL.value
    retryable: bool = False

    def to_wire(self) -> RequestError:
        return RequestError(code=self.code, message=str(self), retryable=self.retryable)


class MultiModalCacheMissError(MMISError):
    """P1 was sent ``data=None`` for items it no longer holds. Lists *all* missing hashes."""

    code = ErrorCode.MULTIMODAL_CACHE_MISS.value
    retryable = True

    def __init__(self, mm_hashes: Iterable[str]) -> None:
        self.mm_hashes: list[str] = list(dict.fromkeys(mm_hashes))
        super().__init__(
            f"{len(self.mm_hashes)} multimodal item(s) not in the engine cache; "
            "resend them with their data"
        )


class ProtocolError(MMISError):
    """A frame or message that does not decode (malformed, unknown type, pickled payload)."""

    code = ErrorCode.INVALID_REQUEST.value
