"""``mmis:lora_requests_info``: the LoRA adapters a P0's engine holds, for the endpoint
picker's LoRA-affinity scorer (issue 47, docs/ROUTING.md).

The shape is vLLM's ``vllm:lora_requests_info``, which the Gateway API inference extension's
``core-metrics-extractor`` reads (``loRASpec``) into a pod's ``ActiveModels`` /
``WaitingModels`` / ``MaxActiveModels``, and its ``lora-affinity-scorer`` scores from: 1 for a
pod whose running adapters include the request's model, 0.8 for a pod with room for one more,
0.6 when it waits, else 0.

Invariants:
- Read at scrape time from ``source`` (P0's adapter registry, ``frontend/client/lora.py``, the
  engine's list as this P0 last learned it: after a load or an unload, at start from
  ``--lora-modules``, and whenever it adopts the engine's list); ``None`` means LoRA is off (or
  not yet known to be on), and then the family is absent.
- One sample: ``model``; ``running_lora_adapters`` the names held, sorted and comma-joined
  (``""`` for none); ``waiting_lora_adapters`` always ``""`` (mmis loads an adapter in the load
  call itself, never on a request's demand, so nothing waits); ``max_lora`` the number held.
  With ``max_lora`` equal to what it holds, a pod that does not hold an adapter has no "room
  for one more" and scores 0, never 0.8: requests for an adapter go to its holders only, and a
  base-model request scores 0 on every pod.
- The value is the Unix time at which this collector first showed the current set (vLLM's
  convention: one series per set, the framework keeps the newest). It changes only when the
  set does. Under ``--api-servers N`` each P0 exposes its own series (``api_server`` label),
  and the newest is that of the P0 that saw the latest change.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmis.telemetry import catalog
from mmis.telemetry.errors import TelemetryError

AdapterSource = Callable[[], Iterable[str] | None]


class LoRAInfoCollector(Collector):
    """Renders ``mmis:lora_requests_info`` from ``source`` at each scrape (module invariants)."""

    def __init__(
        self, model: str, source: AdapterSource, clock: Callable[[], float] = time.time
    ) -> None:
        if not model:
            raise TelemetryError("LoRAInfoCollector needs the served model's name")
        self._model, self._source, self._clock = model, source, clock
        self._lock = threading.Lock()
        self._shown: tuple[str, ...] | None = None
        self._since = 0.0

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected lazily: the adapter set changes between scrapes

    def collect(self) -> Iterator[Metric]:
        names = self._source()
        if names is None:
            return
        held = tuple(sorted(set(names)))
        with self._lock:
            if held != self._shown:
                self._shown, self._since = held, self._clock()
            since = self._since
        spec = catalog.LORA_INFO
        family = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
        family.add_metric([self._model, ",".join(held), "", str(len(held))], since)
        yield family
