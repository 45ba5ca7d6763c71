"""Unit tests of the per-resource coalescing of status refreshes (``reconciler.Refresher``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mmis_operator.kube import KubeError
from mmis_operator.reconciler import Refresher

KEY = ("ns", "svc")


def _recorder() -> tuple[list[str], object]:
    ran: list[str] = []
    lock = threading.Lock()

    def job(label: str) -> object:
        def run() -> None:
            with lock:
                ran.append(label)

        return run

    return ran, job


def test_a_burst_runs_once_with_the_newest_deployment() -> None:
    ran, job = _recorder()

    async def main() -> None:
        refresher = Refresher(delay=0.05)
        for i in range(5):
            refresher.submit_deployment(KEY, job(f"dep{i}"))  # type: ignore[operator]
        await refresher.idle()

    asyncio.run(main())
    assert ran == ["dep4"]


def test_events_during_a_refresh_run_in_the_next_round_never_concurrently() -> None:
    ran: list[str] = []
    running = threading.Event()
    release = threading.Event()
    overlap: list[bool] = []

    def slow() -> None:
        overlap.append(running.is_set())
        running.set()
        release.wait(5)
        ran.append("slow")
        running.clear()

    def fast() -> None:
        overlap.append(running.is_set())
        ran.append("fast")

    async def main() -> None:
        refresher = Refresher(delay=0.01)
        refresher.submit_deployment(KEY, slow)
        while not running.is_set():
            await asyncio.sleep(0.01)
        refresher.submit_deployment(KEY, fast)  # arrives while "slow" runs
        await asyncio.sleep(0.1)
        assert ran == []  # not run next to the running one
        release.set()
        await refresher.idle()

    asyncio.run(main())
    assert ran == ["slow", "fast"]
    assert overlap == [False, False]


def test_the_deployment_runs_first_then_each_pods_newest_event() -> None:
    ran, job = _recorder()

    async def main() -> None:
        refresher = Refresher(delay=0.05)
        refresher.submit_pod(KEY, "p1", job("p1-old"))  # type: ignore[operator]
        refresher.submit_pod(KEY, "p2", job("p2"))  # type: ignore[operator]
        refresher.submit_deployment(KEY, job("dep"))  # type: ignore[operator]
        refresher.submit_pod(KEY, "p1", job("p1-new"))  # type: ignore[operator]
        refresher.submit_deployment(("ns", "other"), job("other"))  # type: ignore[operator]
        await refresher.idle()

    asyncio.run(main())
    assert sorted(ran) == sorted(["dep", "p1-new", "p2", "other"])
    mine = [label for label in ran if label != "other"]
    assert mine == ["dep", "p1-new", "p2"]


def test_a_failing_refresh_is_logged_and_the_rest_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran, job = _recorder()

    def broken() -> None:
        raise KubeError(503, "unavailable")

    async def main() -> None:
        refresher = Refresher(delay=0.01)
        refresher.submit_deployment(KEY, broken)
        refresher.submit_pod(KEY, "p1", job("p1"))  # type: ignore[operator]
        await refresher.idle()
        refresher.submit_deployment(KEY, job("later"))  # type: ignore[operator]
        await refresher.idle()

    asyncio.run(main())
    assert ran == ["p1", "later"]
    assert "status refresh of ns/svc failed" in caplog.text


def test_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        Refresher(delay=-1)
