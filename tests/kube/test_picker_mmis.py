"""The real endpoint picker in the loop (issue 33, docs/ROUTING.md): three ``mmis serve``
replicas announce their caches, ``mmis-epp`` (GIE v1.5.0's runner + the mmis cache scorer)
follows the announcements, and ``mmis-gateway`` speaks the gateway's side of ext_proc and
forwards each request where the picker says (``picker_stack.py``).

- a repeat of a request's image and prefix lands on a replica that holds it in >= 95% of tries,
  while new images spread over the replicas;
- after the holder forgets the prefix (a forced eviction), the picker's index shows it within
  one event batch and the next repeat goes to the other holder;
- a replica's engine restart (a new epoch) empties its index, and requests keep succeeding:
  behind a picker whose silence window outlasts the test, so that only the new epoch's
  detection (a live batch of seq 0 that starts a life, or a replay that no longer holds the
  last batch applied) can empty it, and the picker's log after the kill says so for that
  replica;
- an engine whose events fall silent (stopped) ages out of the picker's trust, and is followed
  again, its index rebuilt from a replay, once it answers;
- LoRA affinity (issue 47): every replica of the module's stack runs with ``--enable-lora``
  and the first one alone holds an adapter (``--lora-modules``); each P0's
  ``mmis:lora_requests_info`` says so, and requests naming the adapter reach that replica in
  >= 95% of tries (counted by each P0's own request counter), none answered with an error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kubecluster import Cluster
from lora_adapters import LM, make_adapter
from picker_stack import SILENCE_S, PickerStack, epp_binary
from procs import children, image_url, wait_for
from tools import go_tool

from mmis.tiny_models.tiny_model import tiny_model_dir
from mmis_operator.routing import EventPorts, picker_config

pytestmark = [pytest.mark.controlplane, pytest.mark.routing, pytest.mark.model, pytest.mark.slow]


def _chat(color: tuple[int, int, int], question: str) -> dict[str, object]:
    return {
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url(color)}},
                    {"type": "text", "text": question},
                ],
            }
        ],
    }


def _color(i: int) -> tuple[int, int, int]:
    return ((37 * i) % 256, (101 * i + 50) % 256, (197 * i + 90) % 256)


RESTART_SILENCE_S = 3600.0  # outlasts the restart test: there, silence never empties an index


@contextlib.contextmanager
def _running_stack(cluster: Cluster, log_dir: Path, **options: Any) -> Iterator[PickerStack]:
    """A :class:`PickerStack` (``options`` as its keywords) in a namespace of its own."""
    epp, gateway = epp_binary(), go_tool("mmis-gateway")
    namespace = "picker-" + os.urandom(4).hex()
    cluster.kubectl("create", "namespace", namespace)
    try:
        with PickerStack(cluster, namespace, log_dir, epp, gateway, **options) as running:
            yield running
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


ADAPTER = "tenant-a"  # a PEFT adapter (tests/lora_adapters.py) the first replica alone holds


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    """Three replicas, LoRA on in each; the first holds :data:`ADAPTER`."""
    out = tmp_path_factory.mktemp("adapter") / ADAPTER
    adapter = make_adapter(tiny_model_dir(), out, LM, rank=4, alpha=8, seed=5)
    options: dict[str, Any] = {
        "serve_args": ("--enable-lora",),
        "replica_args": {0: ("--lora-modules", f"{ADAPTER}={adapter}")},
    }
    with _running_stack(cluster, tmp_path_factory.mktemp("picker"), **options) as running:
        yield running


@pytest.fixture
def patient_stack(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PickerStack]:
    """Two replicas behind a picker whose silenceSeconds (RESTART_SILENCE_S) outlasts the
    test: no index there is emptied for silence."""

    def patient(ops_port: int, events: EventPorts) -> dict[str, Any]:
        return picker_config(ops_port, events, silence_seconds=RESTART_SILENCE_S)

    log_dir = tmp_path_factory.mktemp("picker-restart")
    with _running_stack(cluster, log_dir, replicas=2, config_for=patient) as running:
        yield running


def test_engine_restart_starts_a_new_epoch_and_requests_keep_succeeding(
    patient_stack: PickerStack,
) -> None:
    """First in the module, so that its stack is gone before the module's stack starts."""
    stack = patient_stack
    body = _chat(_color(9), "What is in the picture?")
    a, _ = stack.chat(body)
    replica = next(r for r in stack.replicas if r.ip == a)
    stack.wait_metric(f"{a}'s items known", "mmis_picker_index_items", lambda v: bool(v), pod=a)
    stack.wait_metric(f"{a}'s blocks known", "mmis_picker_index_blocks", lambda v: bool(v), pod=a)
    engines = children(replica.proc.popen.pid)
    assert engines, "mmis serve has no engine child"
    log_from = stack.epp.log_path.stat().st_size  # what the picker logs after the kill
    os.kill(engines[0], signal.SIGKILL)

    def back() -> bool:
        return replica.proc.popen.poll() is None and bool(children(replica.proc.popen.pid))

    wait_for("the engine restarted", back)
    # the restarted engine opens with AllBlocksCleared / EpochStarted: both halves empty, and
    # with silence out of the picture only the new epoch's detection can have emptied them
    # (bounded by the new engine's start-up, which publishes the first batch of its life)
    stack.wait_metric(f"{a} emptied", "mmis_picker_index_items", lambda v: v == 0, 300, pod=a)
    stack.wait_metric(f"{a} emptied", "mmis_picker_index_blocks", lambda v: v == 0, 300, pod=a)
    with stack.epp.log_path.open("rb") as log:
        log.seek(log_from)
        after = log.read().decode(errors="replace").splitlines()
    about_a = [line for line in after if f"tcp://{a}:" in line]
    assert any("restarted" in line for line in about_a), (
        f"the picker logged no restart of {a} after the kill:\n" + "\n".join(after[-30:])
    )
    assert not any("silent" in line for line in about_a), "\n".join(about_a)

    replica.proc.wait_http("/ready", timeout=300)
    for i in range(3):
        stack.chat(_chat(_color(9), f"Question {i}?"))  # never fails for lack of cache data


def test_repeats_land_on_the_replica_that_holds_them(stack: PickerStack) -> None:
    images = range(100, 120)
    holders: dict[int, set[str]] = {}
    for i in images:
        dest, _ = stack.chat(_chat(_color(i), "What is in the picture?"))
        holders[i] = {dest}
    first = [next(iter(h)) for h in holders.values()]
    assert len(set(first)) >= 2, f"new images all went to one replica: {first}"
    hits = tries = 0
    for question in ("And its colours?", "Describe it again."):
        for i in images:
            dest, _ = stack.chat(_chat(_color(i), question))
            tries += 1
            hits += dest in holders[i]
            holders[i].add(dest)
    assert hits / tries >= 0.95, f"{hits}/{tries} repeats reached a holder"


def test_forced_eviction_moves_the_next_choice_within_one_batch(stack: PickerStack) -> None:
    body = _chat(_color(7), "What is in the picture?")
    a, _ = stack.chat(body)
    by_ip = {r.ip: r for r in stack.replicas}
    b = next(ip for ip in by_ip if ip != a)
    # the same request straight to b: now two replicas hold it
    httpx.post(by_ip[b].url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
    stack.wait_metric(f"{b}'s blocks known", "mmis_picker_index_blocks", lambda v: bool(v), pod=b)
    assert by_ip[a].reset_prefix_cache() > 0
    # one batch (AllBlocksCleared) empties a's KV index
    stack.wait_metric(f"{a} emptied", "mmis_picker_index_blocks", lambda v: v == 0, 5, pod=a)
    for _ in range(3):
        dest, _ = stack.chat(body)
        assert dest == b, f"after {a} forgot the prefix the repeat went to {dest}, not {b}"


def test_a_silent_engine_ages_out_and_is_rebuilt_from_a_replay(stack: PickerStack) -> None:
    a, _ = stack.chat(_chat(_color(11), "What is in the picture?"))
    replica = next(r for r in stack.replicas if r.ip == a)
    held = stack.wait_metric(f"{a}'s blocks", "mmis_picker_index_blocks", bool, pod=a)
    engine = children(replica.proc.popen.pid)[0]
    os.kill(engine, signal.SIGSTOP)  # alive but silent: its replay socket stops answering
    try:
        for stream in ("kv", "mm"):
            stack.wait_metric(
                f"{a}'s {stream} stream distrusted", "mmis_picker_stream_live",
                lambda v: v == 0, 4 * SILENCE_S, pod=a, stream=stream,
            )  # fmt: skip
        # untrusted at once (scored as empty), then emptied by the next failed probe
        stack.wait_metric(f"{a} emptied", "mmis_picker_index_blocks", lambda v: v == 0, 5, pod=a)
    finally:
        os.kill(engine, signal.SIGCONT)
    stack.wait_metric(
        f"{a} followed again", "mmis_picker_stream_live", lambda v: v == 1, 30, pod=a, stream="kv"
    )
    # the engine never lost its cache: the replay gives the index back
    stack.wait_metric(f"{a} rebuilt", "mmis_picker_index_blocks", lambda v: v == held, 30, pod=a)


def _chat_requests(replica: Any) -> float:
    """All chat requests a replica's P0 finished, whatever their status."""
    samples = replica.metric("mmis_requests_total", endpoint="/v1/chat/completions")
    return sum(value for _, value in samples)


def test_requests_for_an_adapter_reach_the_replica_that_holds_it(stack: PickerStack) -> None:
    holder, *others = stack.replicas
    info = {r.ip: r.metric("mmis:lora_requests_info") for r in stack.replicas}
    assert [labels for labels, _ in info[holder.ip]] == [
        {"model": "tiny", "running_lora_adapters": ADAPTER, "waiting_lora_adapters": "",
         "max_lora": "1"}
    ], info  # fmt: skip
    for r in others:  # LoRA on, nothing held: the scorer gives them 0 for the adapter
        assert [(s["running_lora_adapters"], s["max_lora"]) for s, _ in info[r.ip]] == [("", "0")]
    before = {r.ip: _chat_requests(r) for r in stack.replicas}
    tries, statuses = 40, []
    for i in range(tries):  # a new first KV block each: no cache match pulls them anywhere
        body = {
            "model": ADAPTER,
            "max_tokens": 2,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"{i:02d}: a tenant's question?"}],
        }
        answer = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)
        statuses.append(answer.status_code)
    landed = {r.ip: _chat_requests(r) - before[r.ip] for r in stack.replicas}
    assert sum(landed.values()) == tries, landed
    assert landed[holder.ip] >= 0.95 * tries, f"{landed} (holder {holder.ip}); {statuses}"
    assert statuses == [200] * tries, statuses
