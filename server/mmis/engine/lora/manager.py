"""The engine's LoRA state for one model: its wrapped projections, the registered adapters,
their host copies and device slots (the one object the runner and the builder talk to).

Invariants:
- :meth:`LoRAManager.attach` wraps every linear projection of the language model's decoder
  layers and of the vision tower and projector (:data:`TOWER_PREFIXES` present in the model) in
  a :class:`~mmis.engine.lora.layer.LoRALinear`; ``lm_head`` and the embeddings are never
  wrapped. Two :class:`~mmis.engine.lora.layer.LoRARows` drive them: ``lm_rows`` (one slot per
  token of the step, set by the runner once per step) and ``tower_rows`` (one slot for a whole
  encoder call: the runner encodes images grouped by adapter).
- :meth:`add` validates an adapter fully (``engine/lora/adapter.py``) before registering it; an
  id or a name is registered once. :meth:`acquire` puts it on a device slot (reloading its host
  copy from its path if the host set dropped it) and pins it; :meth:`release` unpins. An id is
  accepted once for the manager's life (prefix-cache keys chain from it:
  ``protocol/block_keys.py`` ``lora_root``), so no block computed under a removed adapter is
  ever served under a new one. Writing a
  slot happens only in :meth:`acquire`, between steps, so no step reads a half-written slot.
- :meth:`changes_tower` is true iff the adapter has weights under a tower prefix: only then may
  an image's encoder output (and its cache key) depend on the adapter.
- :func:`slot_bytes` is what the wrapping allocates, computed from the same plan before
  anything is allocated: KV sizing (``engine/execution/kv_sizing.py``) holds it aside.
- Tensor parallelism (``engine/execution/tensor_parallel.py``): with ``shards`` (the model's
  ``tp_shards``) each split projection holds this rank's share (``layer.py``), and adapters are
  still checked against the unsplit shapes. Rank 0's manager (``record_writes``) notes every
  slot write of :meth:`acquire` (:meth:`take_writes`: the runner sends them with the step);
  a worker rank's mirror (``tower=False``: the tower runs on rank 0 only, its projections
  checked but not wrapped) replays them with :meth:`write_slot` before the same forward, so
  every rank's slot ``s`` holds the same adapter's share. A write carries rank 0's host copy
  of the adapter itself (unsplit; each rank takes its share): only rank 0 reads adapter files,
  so a worker never meets a file that is gone or changed since rank 0 read it (which would
  end the engine: a worker cannot fail one step alone).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from mmis.engine.lora.adapter import LoRAAdapter, load_adapter
from mmis.engine.lora.errors import (
    LoRAAlreadyLoadedError,
    LoRAError,
    LoRAIdMismatchError,
    LoRAIdReusedError,
    LoRANotLoadedError,
    LoRAPreEncodedError,
)
from mmis.engine.lora.layer import LoRALinear, LoRARows, Shard, buffer_bytes, full_features
from mmis.engine.lora.residency import SlotTable

# the vision tower and projector of each family, as module names in the transformers model
TOWER_PREFIXES = (
    "model.vision_tower",  # LLaVA, LLaVA-NeXT, Gemma 3
    "model.multi_modal_projector",  # LLaVA's projector
    "model.visual",  # Qwen2-VL / Qwen2.5-VL (the merger included)
)
LM_PREFIXES = ("model.language_model.layers",)


@dataclass(frozen=True)
class Registered:
    name: str
    lora_id: int
    path: str
    changes_tower: bool


def _is_projection(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "PackedLinear"  # engine/execution/cpu_linear.py


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _is_projection_or_split(module: torch.nn.Module) -> bool:
    return _is_projection(module) or type(module).__name__ == "RowParallelLinear"


def _targets(
    model: torch.nn.Module, prefixes: tuple[str, ...]
) -> list[tuple[str, torch.nn.Module]]:
    """Every LoRA-capable projection under ``prefixes``, in module order."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if _is_projection_or_split(module) and _under(name, prefixes)
    ]


@dataclass(frozen=True)
class WrapPlan:
    """What :class:`LoRAManager` wraps: name -> this rank's ``(in, out)`` of each wrapped
    projection, and the unsplit ``(in, out)`` of every LoRA-capable one (wrapped or not)."""

    wrapped: dict[str, tuple[int, int]]
    capable: dict[str, tuple[int, int]]


def wrap_plan(
    model: torch.nn.Module,
    *,
    shards: Mapping[str, Shard] | None = None,
    tower: bool = True,
    lm_prefixes: tuple[str, ...] = LM_PREFIXES,
    tower_prefixes: tuple[str, ...] = TOWER_PREFIXES,
) -> WrapPlan:
    """The projections a manager over ``model`` wraps (the module docstring's rules)."""
    shards = shards or {}
    wrapped: dict[str, tuple[int, int]] = {}
    capable: dict[str, tuple[int, int]] = {}
    for name, module in _targets(model, lm_prefixes + tower_prefixes):
        if name not in shards and type(module).__name__ == "RowParallelLinear":
            raise ValueError(f"{name} is split over ranks but has no tensor-parallel shard")
        capable[name] = full_features(module, shards.get(name))
        if tower or not _under(name, tower_prefixes):
            wrapped[name] = (int(module.in_features), int(module.out_features))  # type: ignore[arg-type]
    return WrapPlan(wrapped, capable)


def slot_bytes(
    model: torch.nn.Module,
    *,
    max_loras: int,
    max_rank: int,
    shards: Mapping[str, Shard] | None = None,
    tower: bool = True,
) -> int:
    """Bytes a :class:`LoRAManager` with these settings allocates for its slots on ``model``
    (computed before allocating: KV sizing reserves them)."""
    dtype = next(model.parameters()).dtype
    plan = wrap_plan(model, shards=shards, tower=tower)
    return sum(
        buffer_bytes(n_in, n_out, max_loras + 1, max_rank, dtype)
        for n_in, n_out in plan.wrapped.values()
    )


class LoRAManager:
    """See the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None = None,
        lm_prefixes: tuple[str, ...] = LM_PREFIXES,
        tower_prefixes: tuple[str, ...] = TOWER_PREFIXES,
        shards: Mapping[str, Shard] | None = None,
        tower: bool = True,
        record_writes: bool = False,
    ) -> None:
        self.model, self.max_rank = model, max_rank
        self.table = SlotTable(max_loras, max_cpu_loras)
        self.lm_rows = LoRARows(max_loras + 1)
        self.tower_rows = LoRARows(max_loras + 1)
        self.tower_prefixes = tower_prefixes
        self.layers: dict[str, LoRALinear] = {}
        self._registered: dict[str, Registered] = {}
        self._host: dict[str, LoRAAdapter] = {}
        self._used_ids: set[int] = set()  # never reused, removed adapters' included
        # rank 0 under tensor parallelism: (slot, host copy) written since the last
        # take_writes (None: not recorded)
        self._writes: list[tuple[int, LoRAAdapter]] | None = [] if record_writes else None
        plan = wrap_plan(
            model,
            shards=shards,
            tower=tower,
            lm_prefixes=lm_prefixes,
            tower_prefixes=tower_prefixes,
        )
        self._capable = plan.capable
        self._attach(plan, shards or {})

    def _attach(self, plan: WrapPlan, shards: Mapping[str, Shard]) -> None:
        param = next(self.model.parameters())
        dtype, device = param.dtype, param.device
        for name in plan.wrapped:
            module = self.model.get_submodule(name)
            rows = self.tower_rows if _under(name, self.tower_prefixes) else self.lm_rows
            parent_name, _, attr = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            wrapped = LoRALinear(
                module, rows, self.max_rank, dtype=dtype, device=device, shard=shards.get(name)
            )
            setattr(parent, attr, wrapped)
            self.layers[name] = wrapped

    def modules(self) -> dict[str, tuple[int, int]]:
        """Every LoRA-capable projection: name -> unsplit ``(in_features, out_features)``
        (a worker rank's unwrapped tower projections included)."""
        return dict(self._capable)

    def add(self, name: str, lora_id: int, path: str) -> Registered:
        """Validate and register the PEFT adapter at ``path`` (a typed LoRAError if not)."""
        if name in self._registered:
            raise LoRAAlreadyLoadedError(f"LoRA adapter {name!r} is already loaded")
        if lora_id < 1 or lora_id in self._used_ids:  # an id names one adapter for life
            raise LoRAIdReusedError(
                f"LoRA adapter {name!r}: id {lora_id} is not positive or was used before "
                "(prefix-cache blocks are keyed by it: protocol/block_keys.py)"
            )
        adapter = load_adapter(name, lora_id, path, self.modules(), self.max_rank)
        entry = Registered(name, lora_id, path, adapter.touches(self.tower_prefixes))
        self._registered[name] = entry
        self._used_ids.add(lora_id)
        self._keep_host(adapter)
        return entry

    def _keep_host(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        for gone in self.table.touch_host(adapter.name):
            self._host.pop(gone, None)

    def remove(self, name: str) -> None:
        """Unregister ``name`` (refused while a running request uses it); its slot is zeroed."""
        if name not in self._registered:
            raise LoRANotLoadedError(f"LoRA adapter {name!r} is not loaded")
        slot = self.table.drop(name)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)
        del self._registered[name]
        self._host.pop(name, None)

    def get(self, name: str) -> Registered:
        if name not in self._registered:
            raise LoRANotLoadedError(f"LoRA adapter {name!r} is not loaded")
        return self._registered[name]

    def registered(self) -> Iterator[Registered]:
        return iter(self._registered.values())

    def refusal(self, name: str, lora_id: int, *, pre_encoded: bool = False) -> LoRAError | None:
        """Why a request under ``name`` / ``lora_id`` cannot run, typed (its ``code`` goes on
        the wire; None: it can); ``pre_encoded``: some of its images come as encoder outputs
        (E/PD), which only an adapter that leaves the tower alone can use."""
        entry = self._registered.get(name)
        if entry is None:
            return LoRANotLoadedError(f"LoRA adapter {name!r} is not loaded")
        if entry.lora_id != lora_id:
            return LoRAIdMismatchError(
                f"LoRA adapter {name!r} has id {entry.lora_id}, not {lora_id}"
            )
        if pre_encoded and entry.changes_tower:
            return LoRAPreEncodedError(
                f"LoRA adapter {name!r} changes the vision tower: its images cannot come "
                "pre-encoded (E/PD)"
            )
        return None

    # the engine's utility calls (engine/core.py's table; P0's load/unload API, issue 47)
    def load_call(self, name: str, lora_id: int, path: str) -> dict[str, object]:
        entry = self.add(name, int(lora_id), path)
        return {"name": entry.name, "lora_id": entry.lora_id, "tower": entry.changes_tower}

    def unload_call(self, name: str) -> bool:
        self.remove(name)
        return True

    def list_call(self) -> list[dict[str, object]]:
        return [
            {"name": e.name, "lora_id": e.lora_id, "path": e.path, "tower": e.changes_tower}
            for e in self._registered.values()
        ]

    def changes_tower(self, name: str | None) -> bool:
        return name is not None and self.get(name).changes_tower

    @torch.no_grad()
    def acquire(self, name: str) -> int:
        """Pin ``name`` to a device slot (writing its weights there if needed); its slot."""
        entry = self.get(name)
        got = self.table.acquire(name)
        if got.load:
            adapter = self._host.get(name)
            if adapter is None:  # dropped from the host set: read it again
                adapter = load_adapter(
                    name, entry.lora_id, entry.path, self.modules(), self.max_rank
                )
            self._keep_host(adapter)
            self._write(got.slot, adapter)
            if self._writes is not None:
                self._writes.append((got.slot, adapter))
        return got.slot

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for module, layer in self.layers.items():
            if module in adapter.weights:
                a, b = adapter.weights[module]
                layer.set_slot(slot, a, b)
            else:
                layer.clear_slot(slot)

    def take_writes(self) -> list[tuple[int, LoRAAdapter]]:
        """The slot writes since the last call, in order (``record_writes`` only)."""
        writes, self._writes = self._writes or [], [] if self._writes is not None else None
        return writes

    @torch.no_grad()
    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """A worker rank's replay of rank 0's write (module docstring): this rank's share of
        ``adapter``, rank 0's host copy, into ``slot``; nothing is read from disk."""
        self._write(slot, adapter)

    def release(self, name: str) -> None:
        self.table.release(name)
