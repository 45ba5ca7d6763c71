"""The multimodal item hash (``mm_hash``): one collision-resistant digest per item.

Invariants:
- The digest covers, in this order: a format version, the model id, the modality, the item
  (a decoded PIL image, the original encoded bytes, or a numpy array) and the processor
  kwargs that change the processor's output. A video item (modality ``"video"``) is hashed as
  its sampled frames (one ``[T, H, W, 3]`` uint8 array) with the sampled frame rate among its
  kwargs (``frontend/client/renderer.py``), so the same clip sampled differently is another item.
- The byte stream fed to the hash function is *uniquely decodable*: every value is written as
  ``tag (1 byte) | length (8 bytes, big endian) | payload``, containers as their tag, item
  count and framed items. Two different values therefore never produce the same stream:
  list vs tuple vs nesting, ``None`` vs empty, ``bytes`` vs ``str``, ``1`` vs ``1.0`` vs
  ``True`` are all distinct.
- Dicts are hashed with their keys sorted by the keys' framed bytes, so key order never
  matters; numpy arrays include dtype and shape; images include mode, size, palette and
  transparency, so the same raw bytes under a different layout hash differently.
- An item received encoded (every image a request carries, by data URL, http(s) or file) is
  hashed as its encoded bytes with the identity of the decoder that turns them into pixels
  (:func:`encoded_item_mm_hash`; P0's is ``frontend/client/media/decode.py``
  ``decoder_identity``): decoding is a function of the bytes and that identity, so the hash
  still fixes the pixels, hence the processor's tensors, the engine sees. Which items share a
  hash: the same bytes under the same decoder identity, model, modality and processor kwargs.
  The same pixels in other bytes (re-encoded, recompressed, other metadata) are *another* item
  (a cache miss, never a wrong hit); an in-process image hashed as its pixels (the readiness
  probe) never shares a hash with an encoded one (the item is framed as another type). Before
  this, images were hashed as their decoded pixels (``tobytes`` and a pass over 24-36 MB per
  4-12 MP photo: about a fifth of P0's CPU on a unique photo, benchmarks/README.md, issue 45).
- An item's ``mm_hash`` is always the hash of its content: a client's ``uuid`` never is one,
  never enters one and never leaves P0 (docs/SECURITY.md, "uuids per tenant"). P0 binds a
  uuid sent with data, per tenant, to the content hash of that data, and resolves a uuid
  sent alone through that binding (``frontend/client/tenancy.py``). :func:`validate_uuid`
  checks a uuid (non-empty, printable, at most :data:`MAX_UUID_LENGTH` characters) and raises
  :class:`InvalidItemUUIDError` otherwise; unsupported values raise
  :class:`UnhashableValueError`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any, Final, Protocol

import blake3
import numpy as np
from PIL import Image

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode

HASH_ALGORITHMS: Final = ("blake3", "sha256")
DEFAULT_ALGORITHM: Final = "blake3"
MAX_UUID_LENGTH: Final = 256
FORMAT_VERSION: Final = "mmis-mm-hash/1"

_LENGTH = struct.Struct(">Q")
_FLOAT = struct.Struct(">d")


class HashingError(MMISError):
    """Bad input to the item hash; the client can fix it, so it maps to a 4xx."""

    code = ErrorCode.INVALID_REQUEST.value


class InvalidItemUUIDError(HashingError, ValueError):
    """A user-supplied item uuid that cannot serve as an ``mm_hash``."""


class UnhashableValueError(HashingError, TypeError):
    """A value (item or processor kwarg) of a type the framing does not define."""


class UnknownHashAlgorithmError(HashingError, ValueError):
    """An algorithm name other than those in :data:`HASH_ALGORITHMS`."""


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> _Hasher:
    """A fresh incremental hasher for ``algorithm`` (``"blake3"`` or ``"sha256"``)."""
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise UnknownHashAlgorithmError(
        f"unknown hash algorithm {algorithm!r}; choose one of {', '.join(HASH_ALGORITHMS)}"
    )


def validate_uuid(uuid: object) -> str:
    """Return ``uuid`` if it may name an item (through its tenant's binding), else raise a
    clear error."""
    if not isinstance(uuid, str):
        raise InvalidItemUUIDError(f"item uuid must be a string, got {type(uuid).__name__}")
    if not uuid.strip():
        raise InvalidItemUUIDError("item uuid must not be empty or only whitespace")
    if len(uuid) > MAX_UUID_LENGTH:
        raise InvalidItemUUIDError(
            f"item uuid is {len(uuid)} characters long; the limit is {MAX_UUID_LENGTH}"
        )
    if not uuid.isprintable():
        raise InvalidItemUUIDError("item uuid must contain only printable characters")
    return uuid


def _frame(h: _Hasher, tag: bytes, payload: bytes | memoryview) -> None:
    h.update(tag)
    h.update(_LENGTH.pack(len(payload)))
    h.update(payload)


def _count(h: _Hasher, tag: bytes, n: int) -> None:
    h.update(tag)
    h.update(_LENGTH.pack(n))


def _array(h: _Hasher, arr: np.ndarray) -> None:
    if arr.dtype.hasobject:
        raise UnhashableValueError("numpy arrays of dtype object cannot be hashed")
    _count(h, b"A", 3)
    _frame(h, b"s", arr.dtype.str.encode())
    _feed(h, tuple(int(d) for d in arr.shape))
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    _frame(h, b"b", flat.data)


def _image(h: _Hasher, img: Image.Image) -> None:
    palette: tuple[str, bytes] | None = None
    if img.palette is not None:
        raw_mode = img.palette.mode
        palette = (raw_mode, bytes(img.getpalette(rawmode=raw_mode) or ()))
    _count(h, b"I", 5)
    _feed(h, img.mode)
    _feed(h, tuple(img.size))
    _feed(h, palette)
    _feed(h, img.info.get("transparency"))
    _frame(h, b"b", img.tobytes())


def _feed(h: _Hasher, value: Any) -> None:
    """Write ``value`` into ``h`` as a framed, uniquely decodable record."""
    if value is None:
        _frame(h, b"N", b"")
    elif isinstance(value, bool):  # before int: bool is an int subclass
        _frame(h, b"?", b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        _frame(h, b"i", str(value).encode())
    elif isinstance(value, float):
        _frame(h, b"f", _FLOAT.pack(value))
    elif isinstance(value, str):
        _frame(h, b"s", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes | bytearray | memoryview):
        _frame(h, b"b", memoryview(value).cast("B"))
    elif isinstance(value, np.ndarray):
        _array(h, value)
    elif isinstance(value, np.generic):
        _array(h, np.asarray(value))
    elif isinstance(value, Image.Image):
        _image(h, value)
    elif isinstance(value, list | tuple):
        _count(h, b"l" if isinstance(value, list) else b"t", len(value))
        for item in value:
            _feed(h, item)
    elif isinstance(value, Mapping):
        _mapping(h, value)
    else:
        raise UnhashableValueError(
            f"cannot hash a value of type {type(value).__name__}; use None, bool, int, "
            "float, str, bytes, list, tuple, dict, numpy arrays or PIL images"
        )


def _mapping(h: _Hasher, value: Mapping[Any, Any]) -> None:
    entries: list[tuple[bytes, Any]] = []
    for key, item in value.items():
        key_hasher = _Recorder()
        _feed(key_hasher, key)
        entries.append((key_hasher.data(), item))
    entries.sort(key=lambda entry: entry[0])
    _count(h, b"d", len(entries))
    for key_bytes, item in entries:
        h.update(key_bytes)
        _feed(h, item)


class _Recorder:
    """Collects a framed key so dict entries can be sorted by their encoding."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def update(self, data: bytes | memoryview, /) -> None:
        self._parts.append(bytes(data))

    def hexdigest(self) -> str:  # pragma: no cover - protocol completeness only
        return self.data().hex()

    def data(self) -> bytes:
        return b"".join(self._parts)


def hash_value(value: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of one framed value (exposed for tests and other fingerprints)."""
    h = new_hasher(algorithm)
    _feed(h, value)
    return h.hexdigest()


def hash_item(
    *,
    model_id: str,
    modality: str,
    item: Image.Image | bytes | np.ndarray,
    processor_kwargs: Mapping[str, Any] | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
) -> str:
    """The ``mm_hash`` of one item computed from its content."""
    if not isinstance(item, Image.Image | bytes | bytearray | memoryview | np.ndarray):
        raise UnhashableValueError(
            f"a {modality} item must be a PIL image, encoded bytes or a numpy array, "
            f"got {type(item).__name__}"
        )
    h = new_hasher(algorithm)
    _feed(h, (FORMAT_VERSION, model_id, modality, item, dict(processor_kwargs or {})))
    return h.hexdigest()


def encoded_item_mm_hash(
    *,
    model_id: str,
    modality: str,
    data: bytes | bytearray | memoryview,
    decoder: str,
    processor_kwargs: Mapping[str, Any] | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
) -> str:
    """The ``mm_hash`` of an item received encoded: its bytes as received and ``decoder``, the
    identity of what decodes them (see the module docstring for which items share a hash).
    The item is framed as ``("encoded", decoder, data)``, so it never equals the hash of a
    decoded image, an array or bare bytes given to :func:`hash_item`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise UnhashableValueError(
            f"an encoded {modality} item must be bytes, got {type(data).__name__}"
        )
    h = new_hasher(algorithm)
    item = ("encoded", decoder, data)
    _feed(h, (FORMAT_VERSION, model_id, modality, item, dict(processor_kwargs or {})))
    return h.hexdigest()


def item_mm_hash(
    *,
    model_id: str,
    modality: str,
    item: Image.Image | bytes | np.ndarray | None,
    processor_kwargs: Mapping[str, Any] | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
) -> str:
    """The item's ``mm_hash``: the hash of its content (a uuid alone names no content)."""
    if item is None:
        raise HashingError(
            f"a {modality} item needs its data to be hashed (a uuid alone resolves through "
            "its tenant's binding, never to a hash of its own)"
        )
    return hash_item(
        model_id=model_id,
        modality=modality,
        item=item,
        processor_kwargs=processor_kwargs,
        algorithm=algorithm,
    )
