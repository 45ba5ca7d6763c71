"""docs/ARCHITECTURE.md §1 names every server module one chat-with-image request executes.

ONE ``POST /v1/chat/completions`` with one image (``stream: false``) runs through a real
``mmis serve`` at its defaults (the tiny LLaVA) under the tracer of ``walk_trace/`` (a profile
hook in every process: P0 in the serve process, P1 in its child). Only what runs after start-up
counts: windows are opened once ``/ready`` said yes (the readiness probe's own request is
start-up). Two windows:

- *idle*: nothing sent, for :data:`IDLE_S` (several ping and stats periods): the modules the
  server's timers run whether a request comes or not (pings, the stats poll, P1's idle loop);
- *request*: the one chat, from before its first byte until its answer arrived.

A module is the *request's* when the request window ran code of it (a function, a method, a
comprehension: any code object) that the idle window did not run; §1's walk (its backticked
``*.py`` paths before "Beside the walk", relative to ``server/mmis/``) must name exactly those:
none missing, none that the request did not run. The idle server's other modules (its timers,
and what the request window ran of them is only what the timers run) are §1's *beside the
walk* list, exactly. §1 states the walk's count; it must be the count of modules named.

The same run checks the direction of P0 (issue 45): no call from ``frontend/client`` code into
``frontend/api`` code, and no callable defined in ``api`` handed into ``client``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from procs import ServeFactory, chat_body

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server" / "mmis"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
HOOK = Path(__file__).resolve().parent / "walk_trace"
IDLE_S = 6.0  # ping every 0.5 s, stats every 1 s, liveness 5 s: rounds of each
ACK_S = 30.0


def _walk_section() -> str:
    text = DOC.read_text()
    start = text.index("## 1. One chat request")
    return text[start : text.index("## 1b.", start)]


def documented() -> tuple[set[str], set[str], int | None]:
    """(the walk's modules, the beside-the-walk modules, the count §1 states)."""
    section = _walk_section()
    walk_text, _, beside_text = section.partition("Beside the walk")
    count = re.search(r"executes (\d+) of the server's modules", section)
    return _modules(walk_text), _modules(beside_text), int(count.group(1)) if count else None


def _modules(text: str) -> set[str]:
    """The backticked ``*.py`` paths of ``text`` that name server modules (not this test)."""
    paths = re.findall(r"`([\w/]+\.py)`", text)
    return {p for p in paths if (SERVER / p.split("/")[0]).exists()}


def _wait(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + ACK_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"the tracer did not answer: {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


Calls = dict[str, set[str]]  # module (relative to server/mmis) -> qualified names called


def window(trace: Path, name: str, work: Callable[[], None]) -> tuple[Calls, list[str]]:
    """Run ``work`` inside a window of every live traced process: (what each server module
    ran, the direction crossings)."""
    pids = [int(p.stem) for p in trace.glob("*.pid") if _alive(int(p.stem))]
    (trace / "control").write_text(f"start {name}")
    _wait(f"{name} start", lambda: all((trace / f"{name}.{p}.started").exists() for p in pids))
    work()
    (trace / "control").write_text(f"stop {name}")
    _wait(f"{name} stop", lambda: all((trace / f"{name}.{p}.json").exists() for p in pids))
    calls: Calls = {}
    crossings: list[str] = []
    for pid in pids:
        result = json.loads((trace / f"{name}.{pid}.json").read_text())
        for path, qualname in result["calls"]:
            if path.startswith(f"{SERVER}/"):
                calls.setdefault(str(Path(path).relative_to(SERVER)), set()).add(qualname)
        crossings += result["crossings"]
    return calls, crossings


def test_one_chat_with_an_image_executes_exactly_the_documented_walk(
    start_serve: ServeFactory, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(HOOK), os.environ.get("PYTHONPATH")) if p),
        "MMIS_WALK_TRACE": str(trace),
        "MMIS_WALK_API": f"{SERVER}/frontend/api/",
        "MMIS_WALK_CLIENT": f"{SERVER}/frontend/client/",
        "OMP_NUM_THREADS": "1",
    }
    flags = ("--model", str(tiny_model_dir()), "--served-model-name", "tiny")
    answers: list[httpx.Response] = []
    with start_serve("serve-walk", *flags, env=env) as proc:
        assert len(list(trace.glob("*.pid"))) >= 2, "P0 and P1 are both traced"
        idle, _ = window(trace, "idle", lambda: time.sleep(IDLE_S))

        def chat() -> None:
            url = proc.root_url + "/v1/chat/completions"
            answers.append(httpx.post(url, json=chat_body((200, 40, 90)), timeout=120))

        ran, crossings = window(trace, "request", chat)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["choices"][0]["message"]["content"]
    assert crossings == [], "P0 flows one way (api -> client):\n" + "\n".join(crossings)
    # the request's modules: those where it ran code the idle server did not run
    request = {m for m, names in ran.items() if names - idle.get(m, set())}
    background = set(idle) - request
    walk, beside, count = documented()
    print(
        f"request: {len(request)}",
        *sorted(request),
        f"background: {len(background)}",
        *sorted(background),
        sep="\n  ",
    )
    assert walk == request, (
        f"§1's walk must name exactly the request's modules: executed but not named "
        f"{sorted(request - walk)}, named but not executed {sorted(walk - request)}"
    )
    assert beside == background, (
        f"§1's beside-the-walk list must name exactly what the idle server runs outside the "
        f"walk: missing {sorted(background - beside)}, not run {sorted(beside - background)}"
    )
    assert count == len(walk), f"§1 states {count} modules; its walk names {len(walk)}"
