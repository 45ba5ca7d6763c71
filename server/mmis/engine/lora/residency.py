"""Which adapters are resident: ``--max-loras`` device slots and ``--max-cpu-loras`` host
copies, least recently used first out. Torch-free, so the scheduler can ask it.

Invariants:
- Device slots are numbered 1..``max_loras`` (slot 0 is "no adapter" and is never handed out);
  an adapter holds at most one slot, a slot at most one adapter.
- A slot pinned by a running request (:meth:`SlotTable.acquire` not yet matched by
  :meth:`SlotTable.release`) is never given to another adapter: only unpinned slots are
  evicted, the least recently acquired first. When every slot is pinned by other adapters,
  :meth:`acquire` raises :class:`~mmis.engine.lora.errors.LoRACapacityError` and changes
  nothing; :meth:`can_run` answers the same question without changing anything.
- The host set keeps at most ``max_cpu_loras`` names (>= ``max_loras``), LRU; :meth:`touch_host`
  returns the names it evicted, whose host copies the owner drops (they reload from their path).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from mmis.engine.lora.errors import LoRACapacityError, LoRAInUseError


@dataclass(frozen=True)
class Acquired:
    """The slot an adapter got; ``load``: its weights must be written there (not resident yet);
    ``evicted``: the adapter whose slot it took, if any."""

    slot: int
    load: bool
    evicted: str | None = None


class SlotTable:
    """The device slots and host copies (see the module docstring)."""

    def __init__(self, max_loras: int, max_cpu_loras: int | None = None) -> None:
        cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if cpu < max_loras:
            raise ValueError(f"--max-cpu-loras ({cpu}) must be at least --max-loras ({max_loras})")
        self.max_loras, self.max_cpu_loras = max_loras, cpu
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, LRU first
        self._free = list(range(max_loras, 0, -1))  # pop() hands out 1 first
        self._pins: Counter[str] = Counter()
        self._host: OrderedDict[str, None] = OrderedDict()

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def resident(self) -> dict[str, int]:
        return dict(self._slots)

    def pinned(self, name: str) -> int:
        return self._pins[name]

    def can_run(self, names: Iterable[str]) -> bool:
        """Whether every adapter of ``names`` could hold a slot at once, given the pins."""
        wanted = set(names)
        if len(wanted) > self.max_loras:
            return False
        missing = [n for n in wanted if n not in self._slots]
        evictable = [n for n in self._slots if self._pins[n] == 0 and n not in wanted]
        return len(missing) <= len(self._free) + len(evictable)

    def acquire(self, name: str) -> Acquired:
        """Pin ``name`` to a slot, taking a free one or the LRU unpinned one."""
        slot = self._slots.get(name)
        if slot is not None:
            self._slots.move_to_end(name)
            self._pins[name] += 1
            return Acquired(slot, load=False)
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((n for n in self._slots if self._pins[n] == 0), None)
            if victim is None:
                raise LoRACapacityError(
                    f"LoRA adapter {name!r}: all {self.max_loras} --max-loras slots are in use"
                )
            slot, evicted = self._slots.pop(victim), victim
        self._slots[name] = slot
        self._pins[name] += 1
        return Acquired(slot, load=True, evicted=evicted)

    def release(self, name: str) -> None:
        if self._pins[name] <= 0:
            raise ValueError(f"LoRA adapter {name!r} released more often than acquired")
        self._pins[name] -= 1
        if not self._pins[name]:
            del self._pins[name]

    def drop(self, name: str) -> int | None:
        """Forget ``name`` (unload): its slot, if any, is freed and returned; refused while
        pinned."""
        if self._pins[name]:
            raise LoRAInUseError(f"LoRA adapter {name!r} is in use by running requests")
        self._host.pop(name, None)
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def touch_host(self, name: str) -> list[str]:
        """Mark ``name``'s host copy used; the names whose copies now fall out (LRU)."""
        self._host[name] = None
        self._host.move_to_end(name)
        out = []
        while len(self._host) > self.max_cpu_loras:
            out.append(self._host.popitem(last=False)[0])
        return out
