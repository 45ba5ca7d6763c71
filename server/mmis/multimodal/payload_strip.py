"""Drop tensor payloads that a prefix-cache hit makes useless (scenario S7).

When the prefix cache already covers every placeholder token of an item, no encoder run can
be scheduled for it, so its tensors need not travel to the model runner.

Invariants:
- An item is *covered* when ``placeholder.offset + placeholder.length <= num_computed_tokens``;
  a partially covered item keeps everything.
- A covered item with an inline tensor dict loses it (``data=None``), except for the tensor
  names in ``keep`` (metadata some models still need on the CPU, e.g. the image grid used for
  M-RoPE positions).
- A covered item whose ``data`` is an :class:`ShmAddress` keeps its descriptor: the
  receiver must acknowledge every descriptor it was sent, or the writer's reference count
  never balances and the shared-memory space is never reclaimed.
- The input is never mutated (the scheduler keeps the full features); a new list is returned.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec

from mmis.protocol.messages import MultiModalFeature, ShmAddress


class PayloadStripError(ValueError):
    """``num_computed_tokens`` or a placeholder is out of range."""


def is_covered(feature: MultiModalFeature, num_computed_tokens: int) -> bool:
    end = feature.placeholder.offset + feature.placeholder.length
    return end <= num_computed_tokens


def strip_covered_payloads(
    features: Sequence[MultiModalFeature],
    num_computed_tokens: int,
    *,
    keep: Collection[str] = (),
) -> list[MultiModalFeature]:
    """Return ``features`` with the payloads of prefix-covered items dropped (see module)."""
    if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int):
        raise PayloadStripError(
            f"num_computed_tokens must be an int, got {type(num_computed_tokens).__name__}"
        )
    if num_computed_tokens < 0:
        raise PayloadStripError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
    out: list[MultiModalFeature] = []
    for feature in features:
        ph = feature.placeholder
        if ph.offset < 0 or ph.length < 0:
            raise PayloadStripError(
                f"item {feature.identifier!r} has an invalid placeholder {ph.offset}+{ph.length}"
            )
        data = feature.data
        if (
            data is None
            or isinstance(data, ShmAddress)
            or not is_covered(feature, num_computed_tokens)
        ):
            out.append(feature)
            continue
        kept = {name: value for name, value in data.items() if name in keep}
        out.append(msgspec.structs.replace(feature, data=kept or None))
    return out
