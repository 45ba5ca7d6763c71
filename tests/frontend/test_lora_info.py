"""``mmis:lora_requests_info`` (``telemetry/lora_info.py``), the metric the endpoint picker's
LoRA-affinity scorer reads, fed by P0's own adapter registry (``FrontendState._lora_names``
over ``frontend/client/lora.py``) against test_lora_registry's fake engine:

- absent while LoRA is off (an engine without the LoRA calls), present from start-up with the
  ``--lora-modules`` adapters;
- each change of the set (a load, an unload, the engine's list adopted from a sibling's
  change) is a new series: names sorted and comma-joined, ``max_lora`` how many are held,
  ``waiting_lora_adapters`` empty, the value the Unix time the set was first shown; an
  unchanged set keeps its time (the framework keeps the newest series).

The real P0 -> picker path is tests/kube/test_picker_mmis.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from test_lora_registry import FakeLoRAEngine

from mmis.frontend.client.lora import LoRARegistry
from mmis.frontend.state import FrontendState
from mmis.telemetry.lora_info import LoRAInfoCollector

NAME = "mmis:lora_requests_info"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _scrape(registry: CollectorRegistry) -> list[tuple[dict[str, str], float]]:
    text = generate_latest(registry).decode()
    return [
        (dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == NAME
    ]


def _p0(engine: FakeLoRAEngine, *modules: str, index: int = 0, stride: int = 1) -> Any:
    """A registry and the collector wired as FrontendState wires them."""
    lora = LoRARegistry(engine, modules, index=index, stride=stride)  # type: ignore[arg-type]
    state = SimpleNamespace(lora=lora)
    clock = Clock()
    registry = CollectorRegistry()
    registry.register(LoRAInfoCollector("tiny", lambda: FrontendState._lora_names(state), clock))  # type: ignore[arg-type]
    return lora, registry, clock


def _series(running: str, held: int, when: float) -> list[tuple[dict[str, str], float]]:
    labels = {"model": "tiny", "running_lora_adapters": running}
    labels |= {"waiting_lora_adapters": "", "max_lora": str(held)}
    return [(labels, when)]


async def test_absent_without_lora() -> None:
    lora, registry, _ = _p0(FakeLoRAEngine(enabled=False))
    assert _scrape(registry) == []  # before start-up: not known to be on
    await lora.start()
    assert _scrape(registry) == []


async def test_each_change_of_the_set_is_a_newer_series() -> None:
    engine = FakeLoRAEngine()
    lora, registry, clock = _p0(engine, "b=/b", "a=/a")
    assert _scrape(registry) == []
    await lora.start()
    assert _scrape(registry) == _series("a,b", 2, 1_000.0)
    clock.now = 1_005.0
    assert _scrape(registry) == _series("a,b", 2, 1_000.0)  # unchanged: its time kept
    await lora.load("c", "/c")
    assert _scrape(registry) == _series("a,b,c", 3, 1_005.0)
    clock.now = 1_010.0
    await lora.unload("a")
    await lora.unload("b")
    await lora.unload("c")
    assert _scrape(registry) == _series("", 0, 1_010.0)  # LoRA on, nothing held


async def test_a_siblings_change_shows_when_this_p0_adopts_the_engines_list() -> None:
    engine = FakeLoRAEngine()
    mine, registry, clock = _p0(engine, index=0, stride=2)
    sibling = LoRARegistry(engine, (), index=1, stride=2)  # type: ignore[arg-type]
    await mine.start()
    await sibling.start()
    assert _scrape(registry) == _series("", 0, 1_000.0)
    await sibling.load("x", "/x")
    clock.now = 1_020.0
    assert _scrape(registry) == _series("", 0, 1_000.0)  # not heard of yet
    assert await mine.resolve("x") is not None  # a request for x: the engine's list adopted
    assert _scrape(registry) == _series("x", 1, 1_020.0)
