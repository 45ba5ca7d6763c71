"""The renderer's E/PD step (issue 46): which items an encoder may encode, asking the encoders
for their outputs, and the data relayed to P1 in place of the pixels.

The renderer (``frontend/client/renderer.py`` ``Renderer.render``) processes, on its worker,
the items the shadow says P1 lacks (``Renderer.encoder_asks``: an :data:`Asks` map); this
module awaits their outputs from the :class:`~mmis.frontend.client.encoder_pool.EncoderPool`
on the event loop and turns each answer into the item's data; the worker then renders with it.

Invariants:
- Only an item with pixels or a clip is encodable (:func:`encodable`): a hash-only item (a
  uuid) has nothing to encode, a client's ``image_embeds`` is already an encoder output.
- An item an encoder answered goes to P1 as ``{MM_EMBEDS: output, ...every processor tensor
  but PIXEL_KEYS}`` (``protocol/encoder.py``; Qwen2-VL's ``image_grid_thw`` stays beside it);
  one it did not answer (a fallback, counted by the pool) keeps its processor tensors, i.e.
  its pixels. Either way its placeholder length is the processor's.
- Never raises for an encoder's sake (:meth:`EncoderPool.fetch` does not), and never runs on
  the render worker: the round trip is awaited on the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmis.frontend.client.mm_embeds import PrecomputedEmbeds
from mmis.protocol.encoder import MM_EMBEDS, PIXEL_KEYS, EncodeItem
from mmis.telemetry import tracing as tr

if TYPE_CHECKING:
    from mmis.frontend.client.encoder_pool import EncoderPool

Asks = dict[str, tuple[EncodeItem, dict[str, Any]]]
"""``mm_hash -> (what to ask an encoder, the item's processor tensors)``."""

Precomputed = dict[str, tuple[int, dict[str, Any]]]
"""``mm_hash -> (placeholder length, the data to send P1)``: ``Renderer.render_sync``'s
``precomputed``."""


def encodable(content: object) -> bool:
    """Whether an item with this content (``SourceItem.image``) is one an encoder could
    encode: pixels or a clip (not None, a uuid-only item; not a client's embeddings)."""
    return content is not None and not isinstance(content, PrecomputedEmbeds)


def relayed(tensors: dict[str, Any], embeds: Any) -> dict[str, Any]:
    """What P1 receives for an item an encoder answered: its output and every processor
    tensor but the pixels."""
    return {MM_EMBEDS: embeds, **{k: v for k, v in tensors.items() if k not in PIXEL_KEYS}}


async def ask_encoders(pool: EncoderPool, asks: Asks) -> Precomputed:
    """Every asked item's placeholder length and data: the encoder's output where one
    answered in time, else its processor tensors (see the module's invariants)."""
    fetched = await pool.fetch([ask for ask, _ in asks.values()], tr.inject())
    precomputed: Precomputed = {}
    for mm_hash, (ask, tensors) in asks.items():
        embeds = fetched.embeds.get(mm_hash)
        data = tensors if embeds is None else relayed(tensors, embeds)
        precomputed[mm_hash] = (ask.placeholder_length, data)
    return precomputed
