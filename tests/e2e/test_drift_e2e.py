"""S1 end to end: real ``mmis engine`` + real ``mmis frontend`` processes, real HTTP.

Each variant creates drift between P0's shadow and P1's receiver cache and checks that every
response is a 200 whose completion is token-for-token the drift-free one (greedy decoding):
(a) P1's budget smaller than P0's, (c) two P0 processes on one P1, (d) the operator-only
fault knob evicting on purpose. (b), P1 killed and restarted under a live P0, is S17 in
``test_scenarios_multi_p0_e2e.py`` (under two live P0s: each answers as before the restart)
and ``test_serve.py``'s killed engine (serve restarts it; P0 counts one epoch change).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Frontend, Launcher, chat_body, series

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

COLORS = [(200, 10, 10), (10, 200, 10), (10, 10, 200), (120, 120, 0)]
ITEM_GIB = 13_000 / (1 << 30)  # one tiny-LLaVA image item is ~12.4 kB


def _complete(http: httpx.Client, frontend: Frontend, color: tuple[int, int, int]) -> str:
    response = http.post(frontend.base_url + "/chat/completions", json=chat_body(color))
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int, int], str]:
    """The drift-free outputs: each image sent once, with its data, to a fresh stack."""
    launch = Launcher(tmp_path_factory.mktemp("baseline"))
    try:
        engine = launch.engine("baseline-engine")
        frontend = launch.frontend("baseline-frontend", engine)
        with httpx.Client(timeout=120) as http:
            return {color: _complete(http, frontend, color) for color in COLORS}
    finally:
        launch.close()


def test_s1a_engine_budget_smaller_than_the_shadow(
    launch: Launcher, expected: dict[tuple[int, int, int], str]
) -> None:
    engine = launch.engine("engine", "--mm-cache-gb", f"{2.5 * ITEM_GIB:.12f}")
    frontend = launch.frontend("frontend", engine, "--mm-cache-gb", "1")
    with httpx.Client(timeout=120) as http:
        for _ in range(3):
            for color in COLORS:
                assert _complete(http, frontend, color) == expected[color]
    # drift happened and was handled: prevented by eviction reports, or healed by a retry
    drift = series(frontend, "mmis_drift_misses_total")
    assert series(frontend, "mmis_shadow_invalidations_total") + drift > 0


def test_s1c_two_frontends_feed_one_engine(
    launch: Launcher, expected: dict[tuple[int, int, int], str]
) -> None:
    engine = launch.engine("engine", "--mm-cache-gb", f"{2.5 * ITEM_GIB:.12f}")
    first = launch.frontend("frontend-0", engine, "--client-index", "0", wait=False)
    second = launch.frontend("frontend-1", engine, "--client-index", "1", wait=False)
    first.wait_ready()  # the two loaded side by side
    second.wait_ready()
    with httpx.Client(timeout=120) as http:
        for _ in range(2):
            for color in COLORS:
                assert _complete(http, first, color) == expected[color]
                assert _complete(http, second, color) == expected[color]


def test_s1d_fault_knob_evicts_on_purpose(
    launch: Launcher, expected: dict[tuple[int, int, int], str]
) -> None:
    engine = launch.engine("engine", "--fault-evict-rate", "1.0")
    frontend = launch.frontend("frontend", engine)
    with httpx.Client(timeout=120) as http:
        for _ in range(2):
            for color in COLORS:
                assert _complete(http, frontend, color) == expected[color]
    assert series(frontend, "mmis_drift_misses_total") >= len(COLORS)
    chat = {"endpoint": "/v1/chat/completions", "outcome": "success"}
    assert series(frontend, "mmis_mm_retries_total", **chat) >= len(COLORS)
