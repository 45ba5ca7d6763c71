"""Per-segment keys and the HMAC-SHA256 signature of address descriptors.

Invariants:
- Each segment has its own 32-byte random key, created with the segment. It reaches readers
  through a key file beside the segment, ``<segment>.key``, created exclusively with mode
  0600 (only the owning uid may read it), or through an explicit ``key=`` argument. A reader
  refuses a key file that group or others can read or write.
- The signature covers, in a fixed binary layout, the segment name and the five integers
  (offset, length, handle_id, generation), so changing any of them (or moving a descriptor to
  another segment) invalidates it. Verification is constant-time.
- The signature authenticates descriptors travelling on the wire; it is not a defence against
  a process that can already read the key file (such a process could write the segment too).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
from pathlib import Path

from mmis.protocol.messages import ShmAddress
from mmis.shm.errors import ForgedHandleError, ShmSegmentError

KEY_BYTES = 32
KEY_SUFFIX = ".key"
_FIELDS = struct.Struct("<QQQQ")


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def key_path(directory: Path, segment: str) -> Path:
    return directory / f"{segment}{KEY_SUFFIX}"


def write_key_file(path: Path, key: bytes) -> None:
    """Create ``path`` exclusively with mode 0600 and write ``key`` into it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may have narrowed it; never widen beyond 0600
        os.write(fd, key)
    finally:
        os.close(fd)


def read_key_file(path: Path) -> bytes:
    """Read a key file, refusing one that is missing, the wrong size, or not private."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise ShmSegmentError(f"key file {path} does not exist") from exc
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_IMODE(mode) & 0o077:
            raise ShmSegmentError(
                f"key file {path} has mode {stat.S_IMODE(mode):o}; it must be 0600 (owner only)"
            )
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise ShmSegmentError(f"key file {path} holds {len(key)} bytes, expected {KEY_BYTES}")
    return key


def _message(segment: str, offset: int, length: int, handle_id: int, generation: int) -> bytes:
    name = segment.encode("utf-8")
    try:
        fields = _FIELDS.pack(offset, length, handle_id, generation)
    except struct.error as exc:  # negative or >64-bit fields can only come from tampering
        raise ForgedHandleError(f"descriptor fields out of range: {exc}") from exc
    return struct.pack("<I", len(name)) + name + fields


def sign(
    key: bytes, segment: str, offset: int, length: int, handle_id: int, generation: int
) -> bytes:
    msg = _message(segment, offset, length, handle_id, generation)
    return hmac.new(key, msg, hashlib.sha256).digest()


def verify(key: bytes, address: ShmAddress) -> None:
    """Raise :class:`ForgedHandleError` unless ``address.signature`` matches its fields."""
    expected = sign(
        key,
        address.segment,
        address.offset,
        address.length,
        address.handle_id,
        address.generation,
    )
    if not isinstance(address.signature, bytes) or not hmac.compare_digest(
        expected, address.signature
    ):
        raise ForgedHandleError(
            f"descriptor for handle {address.handle_id} in segment {address.segment!r} "
            "has an invalid signature (forged or tampered)"
        )
