"""S14-S17: several P0s on one P1 with the multimodal cache on, end to end.

One stack, shared by the module's tests in order: a real ``mmis engine`` in SHM mode and two
real ``mmis frontend`` processes (``--client-index 0`` and ``1``) writing into the same shm
directory, driven with the ``openai`` SDK. P1's receiver-cache stores (what crossed from a P0
to P1) are read on P0's ``/metrics`` (``mmis_receiver_cache_stores_total``); what a P0 heard
from P1 of the other's stores on its P0-local levels. The invariant under test is stated in
``server/mmis/multimodal/cache.py``; its unit-level twin is
``tests/multimodal/test_cache_mirror_n.py``.

- S14: an image sent through one P0 is a shadow hit in the other and crosses to P1 once; the
  shadow-hit rate with two P0s on repeated images equals one P0's.
- S15: two P0s racing the same image: both answer the same, at most one store each, and
  every later request of it through either P0 is a hit.
- S16: a P0 SIGKILLed under load (issue 45 item 4): its in-flight requests fail, the other
  P0's do not; its SHM segment is reclaimed by its restart (never the live P0's) and P1 drops
  its mapping; the restarted P0 starts warm (``mm_cache_sync``) and answers the same.
- S17: P1 restarted under both P0s: every shadow empties on the new epoch, answers are the
  same and an image again crosses once; then the fault knob (``set_fault_evict_rate 1``, the
  utility call behind ``--fault-evict-rate``, sent over P1's real socket): each P0's shadow
  hits miss on purpose and the drift chain heals them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).parent))
from procs import Engine, Frontend, Launcher, image_url, series, wait_for

from mmis.protocol.codec import WireCodec
from mmis.protocol.messages import UtilityCall

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

Color = tuple[int, int, int]


@dataclass
class Stack:
    launch: Launcher
    shm: Path
    engine: Engine
    p0: list[Frontend]
    shm_flags: tuple[str, ...]

    def restart_p0(self, index: int) -> Frontend:
        proc = self.launch.frontend(
            f"frontend-{index}-again", self.engine, "--client-index", str(index), *self.shm_flags
        )
        self.p0[index] = proc
        return proc

    def restart_engine(self, name: str, *flags: str) -> None:
        self.engine.stop(signal.SIGKILL)
        self.engine = self.launch.engine(name, *engine_flags(self.shm), *flags)
        for frontend in self.p0:  # both reconnect by themselves: /ready once they did
            frontend.wait_ready()


def engine_flags(shm: Path) -> tuple[str, ...]:
    return ("--mm-cache-type", "shm", "--shm-dir", str(shm))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("multi-p0")
    shm = tmp / "shm"
    shm.mkdir()
    launch = Launcher(tmp)
    try:
        engine = launch.engine("engine", *engine_flags(shm))
        flags = (*engine_flags(shm), "--shm-gb", "0.02", "--stats-interval-s", "0.2")
        p0 = [
            launch.frontend(f"frontend-{i}", engine, "--client-index", str(i), *flags, wait=False)
            for i in (0, 1)
        ]
        for frontend in p0:  # the two loaded side by side
            frontend.wait_ready()
        yield Stack(launch, shm, engine, p0, flags)
    finally:
        launch.close()


def utility(engine: Engine, method: str, *args: Any, client: int = 9) -> Any:
    """One utility call to P1 over its real sockets, as a third client would make it."""
    codec, ctx = WireCodec(), zmq.Context()
    push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    try:
        for sock in (push, sub):
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"c%d" % client)
        sub.connect(engine.output_address)
        push.connect(engine.input_address)
        for call_id in range(1, 200):  # resent until the subscription is live
            push.send_multipart(
                codec.encode_request(UtilityCall(call_id, method, list(args), client))
            )
            while sub.poll(250):
                batch = codec.decode_outputs(sub.recv_multipart()[1:])
                result = batch.utility_result
                if result is not None and result.call_id == call_id:
                    assert result.ok, result.error
                    return result.result
        raise TimeoutError(f"P1 did not answer {method}")
    finally:
        push.close()
        sub.close()
        ctx.term()


def part(color: Color) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": image_url(color)}}


def chat(frontend: Frontend, color: Color) -> str:
    client = openai.OpenAI(base_url=frontend.base_url, api_key="x", timeout=120, max_retries=0)
    out = client.chat.completions.create(
        model="tiny",
        max_tokens=6,
        temperature=0,
        messages=[{"role": "user", "content": [part(color), {"type": "text", "text": "What?"}]}],
    )
    return out.choices[0].message.content or ""


def stores(frontend: Frontend) -> float:
    return series(frontend, "mmis_receiver_cache_stores_total")


def receiver_queries(frontend: Frontend) -> float:
    return series(frontend, "mmis_receiver_cache_queries_total")


def hits(frontend: Frontend) -> float:
    return series(frontend, "mmis_shadow_hits_total")


def misses(frontend: Frontend) -> float:
    return series(frontend, "mmis_drift_misses_total")


def heard(frontend: Frontend) -> float:
    """Items this P0 heard other P0s stored: learned, or queued for its next render."""
    return frontend.metric("shadow_pending_learned") + frontend.metric("shadow_learned_total")


def wait_heard(frontend: Frontend, at_least: float, timeout: float = 30.0) -> None:
    wait_for("the P0 hears the other's stores", lambda: heard(frontend) >= at_least, timeout)


def quiet_stores(frontend: Frontend) -> float:
    """P1's stores once the stats poll (every 0.2 s) has caught up with what already happened:
    the same figure twice, 0.6 s apart (nothing else runs meanwhile). After a P1 restart the
    first polls may still lag the requests just made, and a count taken then is short."""
    last = stores(frontend)
    for _ in range(50):
        time.sleep(0.6)
        now = stores(frontend)
        if now == last:
            return now
        last = now
    raise AssertionError(f"P1's store count never settled (last {last})")


def settled(frontend: Frontend, before: float) -> float:
    """P1's stores + receiver lookups once a request's effect shows (the stats poll lags)."""
    wait_for("P1's figures", lambda: stores(frontend) + receiver_queries(frontend) > before, 30)
    return stores(frontend)


# ---------------------------------------------------------------------------- S14
def test_s14_an_image_sent_through_one_p0_crosses_once_and_hits_in_the_other(
    stack: Stack,
) -> None:
    a, b = stack.p0
    color = (210, 40, 90)
    # P1's count already holds what it stored while the stack started (2 here), which the
    # stats poll may not have reported yet when the test begins
    before, known = quiet_stores(a), heard(b)
    first = chat(a, color)
    wait_for("P1 stored it", lambda: stores(a) == before + 1, 30)
    with contextlib.suppress(TimeoutError):  # b is idle: its heartbeat's answer tells it
        wait_heard(b, known + 1, timeout=5)  # (what is asserted is what P1 stored)
    b_hits, queries = hits(b), stores(b) + receiver_queries(b)
    assert chat(b, color) == first
    assert settled(b, queries) == before + 1  # crossed to P1 once for the pod
    assert hits(b) == b_hits + 1


def test_s14_shadow_hit_rate_with_two_p0s_is_one_p0s(stack: Stack) -> None:
    a, b = stack.p0

    def rate(colors: list[Color], route: list[list[Frontend]]) -> float:
        before = hits(a) + hits(b)
        for round_, frontends in enumerate(route):
            for color, frontend in zip(colors, frontends, strict=True):
                chat(frontend, color)
            if round_ == 0:
                wait_heard(b, heard_b + len(colors))  # the other P0 hears (heartbeat)
        return (hits(a) + hits(b) - before) / (len(colors) * len(route))

    heard_b = heard(b)
    one = [(11, 12, 13 + i * 40) for i in range(4)]
    one_p0 = rate(one, [[a] * 4] * 3)
    heard_b = heard(b)
    two = [(101, 12 + i * 40, 13) for i in range(4)]
    two_p0 = rate(two, [[a] * 4, [b, a, b, a], [a, b, a, b]])  # each image through both
    assert one_p0 == pytest.approx(8 / 12)
    assert two_p0 >= 0.9 * one_p0, (one_p0, two_p0)


# ---------------------------------------------------------------------------- S15
def test_s15_two_p0s_racing_the_same_image(stack: Stack) -> None:
    a, b = stack.p0
    colors = [(5, 180 + i, 60) for i in range(3)]
    before, drift = stores(a), misses(a) + misses(b)
    for color in colors:
        barrier = threading.Barrier(2)

        def send(frontend: Frontend, color: Color = color, barrier: Any = barrier) -> str:
            barrier.wait(30)
            return chat(frontend, color)

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(send, (a, b)))
        assert answers[0] == answers[1]
    wait_for("P1 stored them", lambda: stores(a) >= before + len(colors), 30)
    raced = quiet_stores(a)  # a racing twin's store may still be on its way to the poll
    assert raced <= before + 2 * len(colors)  # at most once per P0
    for frontend in (a, b):
        for color in colors:
            queries = stores(frontend) + receiver_queries(frontend)
            h = hits(frontend)
            chat(frontend, color)
            assert settled(frontend, queries) == raced  # never again
            assert hits(frontend) == h + 1
    assert misses(a) + misses(b) == drift


# ---------------------------------------------------------------------------- S16
def _segments(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if not p.name.endswith(".key")}


def _owned_segment(pid: int, directory: Path) -> str:
    """The segment file the P0 process ``pid`` holds open (its writer's lock)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.parent == directory.resolve() and not target.name.endswith(".key"):
            return target.name
    raise AssertionError(f"P0 {pid} holds no segment in {directory}")


def test_s16_a_p0_killed_under_load_leaks_no_segment_and_restarts_warm(stack: Stack) -> None:
    a, b = stack.p0
    survivor = _owned_segment(a.popen.pid, stack.shm)
    dead = _owned_segment(b.popen.pid, stack.shm)
    assert _segments(stack.shm) == {survivor, dead}
    known = (210, 40, 90)  # S14's image: in P1 (and in both shadows)
    expected = chat(a, known)
    stop = threading.Event()
    b_done, a_answers = [0], []

    def load_b() -> list[BaseException]:
        errors: list[BaseException] = []
        for i in range(200):  # a new image each time: every request writes into SHM
            if stop.is_set():
                break
            try:
                chat(b, (i % 250, 77, (i * 7) % 250))
                b_done[0] += 1
            except openai.APIError as exc:  # killed under us: a clear client-side error
                errors.append(exc)
        return errors

    def load_a() -> None:
        while not stop.is_set():
            a_answers.append(chat(a, known))

    with ThreadPoolExecutor(2) as pool:
        b_errors = pool.submit(load_b)
        a_load = pool.submit(load_a)
        wait_for("P0 1 serves under load", lambda: b_done[0] >= 3, 60)
        b.stop(signal.SIGKILL)
        wait_for("P0 1's requests fail", lambda: b_errors.done() or len(a_answers) > 400, 60)
        stop.set()
        errors = b_errors.result(60)
        a_load.result(60)
    assert errors, "the killed P0's in-flight request did not fail"
    assert a_answers and set(a_answers) == {expected}  # the other P0 was unaffected
    assert _segments(stack.shm) == {survivor, dead}  # left behind until a writer reclaims it

    before = stores(a)
    restarted = stack.restart_p0(1)  # same client index, same shm directory
    fresh = _owned_segment(restarted.popen.pid, stack.shm)
    assert _segments(stack.shm) == {survivor, fresh}  # the dead one reclaimed, the live kept
    maps = Path(f"/proc/{stack.engine.popen.pid}/maps")
    wait_for("P1 drops the dead segment's mapping", lambda: dead not in maps.read_text(), 30)
    assert restarted.metric("shadow_resets_total") >= 1
    assert heard(restarted) >= 1  # mm_cache_sync: it starts knowing what P1 holds
    queries = stores(a) + receiver_queries(a)
    h = hits(restarted)
    assert chat(restarted, known) == expected
    assert hits(restarted) == h + 1  # warm: no data resent
    assert settled(a, queries) <= before + 1  # only its readiness probe's image, if any


# ---------------------------------------------------------------------------- S17
def test_s17_p1_restarted_under_two_p0s(stack: Stack) -> None:
    a, b = stack.p0
    known = (210, 40, 90)
    expected = chat(a, known)
    epochs = [f.metric("epoch_changes_total") for f in (a, b)]
    stack.restart_engine("engine-2")
    for frontend, epoch in zip((a, b), epochs, strict=True):
        wait_for("the new epoch", lambda f=frontend, e=epoch: f.metric("epoch_changes_total") > e)
        assert chat(frontend, known) == expected  # healed: the shadow emptied, or one retry
    color = (33, 66, 199)
    before, known_b = quiet_stores(a), heard(b)
    first = chat(a, color)
    wait_for("P1 stored it", lambda: stores(a) == before + 1, 30)
    wait_heard(b, known_b + 1)
    queries = stores(b) + receiver_queries(b)
    assert chat(b, color) == first
    assert settled(b, queries) == before + 1  # coherent again under the new epoch


def test_s17_the_fault_knob_with_two_p0s_heals_by_the_chain(stack: Stack) -> None:
    assert utility(stack.engine, "set_fault_evict_rate", 1.0) == 1.0
    a, b = stack.p0
    color = (140, 140, 7)
    known_b = heard(b)
    first = chat(a, color)
    wait_heard(b, known_b + 1)
    drift = [misses(f) for f in (a, b)]
    healed = [series(f, "mmis_mm_retries_total", outcome="success") for f in (a, b)]
    seen = []
    for frontend in (b, a, b):  # each a shadow hit that P1 drops on purpose
        h = hits(frontend)
        assert chat(frontend, color) == first
        seen.append((hits(frontend) - h, misses(a) - drift[0], misses(b) - drift[1]))
    assert misses(b) >= drift[1] + 2 and misses(a) >= drift[0] + 1, seen
    assert series(b, "mmis_mm_retries_total", outcome="success") >= healed[1] + 2
    assert series(a, "mmis_mm_retries_total", outcome="success") >= healed[0] + 1
