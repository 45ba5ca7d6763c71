"""P0's ``/metrics`` and ``/stats/cache`` wired to the running server (scripted P1).

Real P0 (uvicorn, FastAPI, renderer, shadow, engine client), real ZMQ, the real P1 shell and
receiver cache; the core is scripted and answers the ``stats`` utility with
``EngineStats(...).to_dict()`` built from its live state, as the real core does.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend, ScriptedCore, image_part
from scripted_stack import StackFactory

from mmis.frontend.client.engine_client import EngineClient
from mmis.telemetry import catalog
from mmis.telemetry.engine_stats import EngineStats

pytestmark = pytest.mark.timeout(180)


class StatsCore(ScriptedCore):
    """The scripted core, answering ``stats`` like the real one (from its live state)."""

    def utilities(self) -> dict[str, Callable[..., Any]]:
        return super().utilities() | {"stats": self.stats}

    def stats(self) -> dict[str, Any]:
        running = len(self.running)
        return EngineStats(
            num_requests_running=running, kv_cache_usage=min(running / 4, 1.0)
        ).to_dict() | {"engine_detail": 7}


@pytest.fixture
def stack(start_stack: StackFactory) -> tuple[FakeEngine, RunningFrontend]:
    return start_stack(StatsCore(), drift_window_s=1.0, stats_interval_s=0.2)


Key = tuple[str, frozenset[tuple[str, str]]]


def samples(text: str) -> dict[Key, float]:
    """``{(name, labels): value}`` of a text exposition (label order does not matter)."""
    out: dict[Key, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            name, _, labels = sample.partition("{")
            pairs = (p.split("=", 1) for p in labels.rstrip("}").split('",') if p)
            out[name, frozenset((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


def key(name: str, **labels: str) -> Key:
    return name, frozenset(labels.items())


def chat(color: tuple[int, int, int], max_tokens: int = 4) -> dict[str, Any]:
    content = [image_part(color), {"type": "text", "text": "what is it?"}]
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    }


def test_metrics_serve_one_registry_with_p1_figures_and_histograms(
    stack: tuple[FakeEngine, RunningFrontend],
) -> None:
    engine, frontend = stack
    root = frontend.root_url
    tiny = {"model": "tiny"}
    chat_route = {**tiny, "endpoint": "/v1/chat/completions"}
    with httpx.Client(timeout=30) as http:
        for _ in range(2):  # the second one is a shadow hit, resolved by P1's receiver
            reply = http.post(f"{root}/v1/chat/completions", json=chat((9, 99, 199)))
            assert reply.status_code == 200, reply.text
        with engine.held():  # one request stays running in P1 while we scrape
            done = threading.Event()

            def send() -> None:
                httpx.post(f"{root}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                done.set()

            threading.Thread(target=send, daemon=True).start()
            assert engine.core.request_added.wait(30)
            deadline = time.monotonic() + 30
            while True:  # the next poll (or the scrape itself) picks the running request up
                text = http.get(f"{root}/metrics").text
                if samples(text).get(key("mmis:num_requests_running", **tiny)) == 1.0:
                    break
                assert time.monotonic() < deadline, text
        assert done.wait(30)
        counted = key("mmis_requests_total", **tiny, endpoint="/v1/completions", status="2xx")
        while counted not in samples(text := http.get(f"{root}/metrics").text):
            assert time.monotonic() < deadline, text  # counted once its last byte went out
    values = samples(text)
    assert values[key("mmis_engine_up", **tiny)] == 1.0
    assert values[key("mmis:kv_cache_usage_perc", **tiny)] in (0.0, 0.25)  # a recent poll
    assert key("mmis:num_requests_waiting", **tiny) in values
    assert values[key("mmis_receiver_cache_hits_total", **tiny)] >= 1  # P1's receiver
    assert values[key("mmis_shadow_hits_total", **tiny)] >= 1
    assert values[key("mmis_requests_total", **chat_route, status="2xx")] == 2
    assert values[key("mmis_request_latency_seconds_count", **chat_route)] == 2
    assert values[key("mmis_time_to_first_token_seconds_count", **chat_route)] == 2
    assert values[key("mmis_time_per_output_token_seconds_count", **chat_route)] == 6
    assert values[key("mmis_generation_tokens_total", **tiny)] == 4 + 4 + 2
    # one registry: no default-registry series, no second copy of a catalog counter
    names = {name for name, _ in values}
    assert not any(n.startswith(("python_", "process_")) for n in names), text
    assert "mmis_frontend_shadow_hits_total" not in names
    assert values[key("mmis_frontend_engine_requests_in_flight")] == 0
    created = {f"{n.removesuffix('_total')}_created" for n in catalog.BY_NAME}
    unknown = names - catalog.series_names() - created
    assert all(n.startswith("mmis_frontend_") for n in unknown), unknown
    for name, labels in values:  # labels come from the closed sets only: no ids, no hashes
        assert {k for k, _ in labels} <= catalog.ALLOWED_LABELS | {"le"}, (name, labels)


async def test_stats_cache_drift_rises_under_the_fault_knob_and_falls_back(
    stack: tuple[FakeEngine, RunningFrontend],
) -> None:
    engine, frontend = stack
    root = frontend.root_url
    knob = EngineClient(engine.input_address, engine.output_address, client_index=5)
    await knob.start(timeout=30)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            probe = (await http.get(f"{root}/stats/cache")).json()
            assert probe["drift_rate"] == 0.0 and probe["window_seconds"] == 1.0

            async def send(color: tuple[int, int, int]) -> None:
                reply = await http.post(f"{root}/v1/chat/completions", json=chat(color))
                assert reply.status_code == 200, reply.text

            await send((1, 2, 3))  # now in the shadow and in P1
            assert await knob.call_utility("set_fault_evict_rate", 1.0) == 1.0
            for _ in range(3):  # each: shadow hit, P1 evicted it, miss, healed by the retry
                await send((1, 2, 3))
            drifted = (await http.get(f"{root}/stats/cache")).json()
            assert drifted["drift_rate"] > 0.5, drifted
            assert drifted["drift_misses"] >= 1 and drifted["retries"] >= 1
            gauge = samples((await http.get(f"{root}/metrics")).text)
            assert gauge[key("mmis_drift_rate", model="tiny")] > 0.5

            assert await knob.call_utility("set_fault_evict_rate", 0.0) == 0.0
            deadline = time.monotonic() + 30
            while True:  # clean traffic until the 1 s window has slid past the drift
                await send((1, 2, 3))
                healed = (await http.get(f"{root}/stats/cache")).json()
                if healed["drift_rate"] == 0.0 and healed["shadow_hits"] > 0:
                    break
                assert time.monotonic() < deadline, healed
    finally:
        await knob.close()
