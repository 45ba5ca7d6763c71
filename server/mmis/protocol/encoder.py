"""Encoder disaggregation (E/PD) on the wire: P0 <-> ``mmis encoder``, and what P1 receives.

The layout (docs/ARCHITECTURE.md, "Encoder disaggregation"): P0 processes an image as today,
then, for an item its shadow says P1 lacks, asks the encoder that rendezvous hashing of the
item's ``mm_hash`` picks (``frontend/client/encoder_pool.py``) for the item's encoder output,
and relays that output to P1 over the pod's SHM in place of the pixels (the item's ``data``
is then ``{MM_EMBEDS: [placeholder_length, hidden] tensor, ...the small metadata tensors}``).
P1 checks it (``engine/encoder_inputs.py``) and treats anything wrong as a miss; P0 falls back
to the pixels (P1 encodes locally) when no encoder answers in time. Nothing here is required:
without encoders nothing changes.

Transport: one ZMQ ROUTER per encoder (``mmis encoder --endpoint``), one DEALER per encoder in
each P0; every message is one :class:`EncodeRequest` or :class:`EncodeReply` encoded by
``protocol/codec.py``'s :class:`~mmis.protocol.codec.WireCodec` (tensors as zero-copy frames,
bounded decode). A socket off loopback needs the token (ZMQ PLAIN + ZAP, as the event streams:
``engine/event_auth.py``).

Invariants:
- ``request_id`` is P0's own counter, echoed: no client-chosen id or prompt text ever reaches an
  encoder; only item tensors, their hashes and the trace context do.
- An :class:`EncodeRequest` with no items is a health ping; its reply carries the encoder's
  :class:`EncoderKey` and no items.
- The encoder answers with the key it encoded under; P0 uses an output only when that key and
  the item's ``mm_hash`` equal what it asked for (a mislabelled reply is a fallback).
- Append-only fields with defaults, as ``protocol/messages.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mmis.protocol.messages import RequestError

MM_EMBEDS = "mm_embeds"
"""The item-data key of a precomputed encoder output, ``[placeholder_length, hidden]`` in the
engine's dtype. An item whose data holds it is not encoded by P1 (``engine/execution/runner.py``),
after P1 checked it (``engine/encoder_inputs.py``)."""

PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
"""The processor tensors an encoder output replaces in the item's data; every other tensor of
the item (Qwen2-VL's ``image_grid_thw``, ...) stays beside :data:`MM_EMBEDS`."""


class EncoderKey(msgspec.Struct, array_like=True, frozen=True):
    """What an encoder output depends on besides the item (whose ``mm_hash`` already covers the
    pixels and the processor kwargs): the model, its revision and the output dtype."""

    model: str
    revision: str = ""
    dtype: str = ""


class EncodeItem(msgspec.Struct, array_like=True, kw_only=True):
    """One item to encode. ``data`` holds the processor tensors (``pixel_values``, grids)."""

    mm_hash: str
    modality: str = "image"
    placeholder_length: int
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class EncodeRequest(msgspec.Struct, array_like=True):
    request_id: int
    key: EncoderKey
    items: list[EncodeItem] = msgspec.field(default_factory=list)
    trace_context: dict[str, str] = msgspec.field(default_factory=dict)


class EncodedItem(msgspec.Struct, array_like=True, kw_only=True):
    """One item's answer: ``embeds`` (``[placeholder_length, hidden]``, ``key.dtype``), or
    ``None`` with ``error`` saying why. ``cached``: served from the encoder's cache."""

    mm_hash: str
    embeds: Any = None
    error: RequestError | None = None
    cached: bool = False


class EncodeReply(msgspec.Struct, array_like=True):
    request_id: int
    key: EncoderKey
    items: list[EncodedItem] = msgspec.field(default_factory=list)
    error: RequestError | None = None
