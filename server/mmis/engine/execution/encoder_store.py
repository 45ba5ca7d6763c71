"""The runner's encoder outputs: each multimodal item's embeddings on the model's device, by
key (``mm_hash``; the scheduler's ``encoder_key`` under LoRA, ``scheduling/request.py``).

Invariants:
- The vision encoder runs at most once per key while it stays in the store: :meth:`encode`
  skips stored items, and only the scheduler frees one (``freed_encoder_hashes``, through
  :meth:`free`).
- An item that brought its encoder output (``MM_EMBEDS``, checked by P1's input thread,
  ``engine/encoder_inputs.py``) is stored as it is, moved to the model's device and dtype.
- One encoder call per adapter that changes the tower (``engine/lora/``), the base tower for
  the rest; a stored output has exactly its placeholder's number of rows
  (:class:`~mmis.engine.execution.step_errors.StepInputError` otherwise).
- :meth:`scatter` overwrites the rows of a packed step's embeddings that fall inside an item's
  placeholder (a chunk may start or end inside one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from mmis.engine.execution.model.adapter import ModelAdapter
from mmis.engine.execution.step_errors import EncoderOutputMissingError, StepInputError
from mmis.engine.scheduling.sched_output import ScheduledRequest
from mmis.protocol.encoder import MM_EMBEDS

if TYPE_CHECKING:
    from mmis.engine.lora.manager import LoRAManager


class EncoderStore:
    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.outputs: dict[str, torch.Tensor] = {}
        self.num_calls = 0  # vision encoder calls so far

    def free(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.outputs.pop(key, None)

    def encode(
        self,
        seqs: Sequence[ScheduledRequest],
        lora: LoRAManager | None = None,
        lora_slots: Mapping[str | None, int] | None = None,
    ) -> list[str]:
        """Store the encoder output of every item of ``seqs`` that brought tensors and is not
        stored yet; returns their keys. ``lora_slots``: the device slot of each adapter of the
        step (pinned by the runner for it)."""
        todo: dict[str, tuple[int, object]] = {}
        given: list[str] = []
        for s in seqs:
            for item in s.mm_items:
                if item.data is None or item.mm_hash in self.outputs:
                    continue
                if MM_EMBEDS in item.data:
                    self._store(item.mm_hash, item.length, torch.as_tensor(item.data[MM_EMBEDS]))
                    given.append(item.mm_hash)
                    continue
                todo.setdefault(item.mm_hash, (item.length, item.data))
        if not todo:
            return given
        groups = _tower_groups(seqs, lora)
        by_lora: dict[str | None, list[str]] = {}
        for key in todo:  # one encoder call per adapter that changes the tower
            by_lora.setdefault(groups.get(key), []).append(key)
        for lora_name, group in by_lora.items():
            datas = [todo[k][1] for k in group]
            if lora is None or lora_name is None or lora_slots is None:
                embeddings = self.adapter.encode_images(datas)  # type: ignore[arg-type]
            else:
                embeddings = self._encode_under(lora, lora_slots[lora_name], datas)
            self.num_calls += 1
            for key, emb in zip(group, embeddings, strict=True):
                self._store(key, todo[key][0], emb)
        return given + [k for group in by_lora.values() for k in group]

    def scatter(self, embeds: torch.Tensor, seqs: Sequence[ScheduledRequest]) -> None:
        """Write each stored item's rows into ``embeds`` (the step's packed rows)."""
        offset = 0
        for s in seqs:
            start, end = s.start_position, s.end_position
            for item in s.mm_items:
                lo, hi = max(item.offset, start), min(item.end, end)
                if lo >= hi:
                    continue
                stored = self.outputs.get(item.mm_hash)
                if stored is None:
                    raise EncoderOutputMissingError(
                        f"request {s.request_id}: no encoder output for item {item.mm_hash}"
                    )
                rows = stored[lo - item.offset : hi - item.offset]
                embeds[offset + lo - start : offset + hi - start] = rows.to(embeds.dtype)
            offset += s.num_tokens

    def _encode_under(
        self, lora: LoRAManager, slot: int, datas: list[object]
    ) -> list[torch.Tensor]:
        adapter = self.adapter
        lora.tower_rows.select([slot], dtype=adapter.dtype, device=adapter.device)
        try:
            return adapter.encode_images(datas)  # type: ignore[arg-type]
        finally:
            lora.tower_rows.clear()

    def _store(self, key: str, length: int, emb: torch.Tensor) -> None:
        if emb.shape[0] != length:
            raise StepInputError(
                f"item {key}: encoder gave {emb.shape[0]} embeddings for a placeholder "
                f"of {length} tokens"
            )
        self.outputs[key] = emb.to(self.adapter.device, self.adapter.dtype)


def _tower_groups(
    seqs: Sequence[ScheduledRequest], lora: LoRAManager | None
) -> dict[str, str | None]:
    """key -> the adapter its encoder call runs under (None: the base tower; also for adapters
    that leave the tower alone)."""
    if lora is None:
        return {}
    return {
        item.mm_hash: s.lora_name if lora.changes_tower(s.lora_name) else None
        for s in seqs
        for item in s.mm_items
    }
