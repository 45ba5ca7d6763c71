"""LoRA under ``--api-servers 2`` (issue 47): two P0 processes behind one port share one
engine's adapters, end to end.

One module-scoped ``mmis serve --api-servers 2 --lora-modules a=<dir>
--allow-runtime-lora-updating --ops-port 0`` (tiny LLaVA, one OpenMP thread); the openai SDK
and httpx, a fresh connection per request (accepted by whichever process is free). Which
process answered is read from ``mmis_requests_total{api_server}`` on the operations port
(``test_api_servers.py``'s :class:`Group`), round after round of concurrent requests until
both have answered:

- ``a`` (``--lora-modules``: both processes load it at start-up, the second adopts the
  first's) answers the same on both processes, differently from the base.
- ``b``, loaded at run time by one POST (so through one process), is served by both (the
  other one never saw the load: it asks the engine), with the same answer on both, unlike
  ``a``'s; eight listings of ``/v1/models`` name it (which process answered a listing is not
  counted).
- ``b`` unloaded by one POST is a 404 ``model_not_found`` on both (the other one's stale id is
  refused by the engine, looked up again, and gone); ``a`` still answers as before.
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the adapter maker
sys.path.insert(0, str(Path(__file__).parent))  # first: tests/e2e's conftest
from conftest import ONE_THREAD
from lora_adapters import LM, make_adapter
from procs import ServeFactory, image_url, openai_client, wait_for
from test_api_servers import READY_LINE, Group

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(300)]

ROUNDS = 8  # rounds of concurrent requests at most, until both processes have answered


@pytest.fixture(scope="module")
def pair(start_serve: ServeFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("lora-siblings")
    model = tiny_model_dir()
    dirs = {
        "a": make_adapter(model, root / "a", LM, rank=8, alpha=16, seed=1),
        "b": make_adapter(model, root / "b", LM, rank=4, alpha=8, seed=7),
    }
    flags = ["--model", str(model), "--served-model-name", "tiny", "--api-servers", "2"]
    flags += ["--ops-port", "0", "--max-loras", "2", "--max-lora-rank", "8"]
    flags += ["--lora-modules", f"a={dirs['a']}", "--allow-runtime-lora-updating"]
    with start_serve("serve-lora-siblings", *flags, env=ONE_THREAD) as proc:
        group = Group(proc)
        log = proc.log_path
        wait_for("both processes ready", lambda: log.read_text().count(READY_LINE) == 2, 120)
        group.dirs = dirs  # type: ignore[attr-defined]
        yield group


def _chat(group: Group, model: str) -> str:
    """One greedy 6-token image chat under ``model`` on a fresh connection; its text."""
    with openai_client(group.proc) as client:
        out = client.chat.completions.create(
            model=model,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image_url((200, 30, 90))}},
                        {"type": "text", "text": "What is in the picture?"},
                    ],
                }
            ],
        )
    return out.choices[0].message.content or ""


def _models(group: Group) -> set[str]:
    with openai_client(group.proc) as client:
        return {m.id for m in client.models.list().data}


def _on_both(group: Group, call: Callable[[], Any]) -> list[Any]:
    """``call``'s results, four at a time on fresh connections, until both processes have
    answered at least one (by ``mmis_requests_total``'s delta per process)."""
    before = group.by_index("mmis_requests_total")
    results: list[Any] = []
    for _ in range(ROUNDS):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results += list(pool.map(lambda _: call(), range(4)))
        after = group.by_index("mmis_requests_total")
        if all(after.get(k, 0.0) > before.get(k, 0.0) for k in ("0", "1")):
            return results
    raise AssertionError(f"one process answered nothing in {ROUNDS} rounds: {before} {after}")


def test_an_adapter_loaded_through_one_process_is_served_and_unloaded_through_both(
    pair: Any,
) -> None:
    base = _chat(pair, "tiny")
    under_a = _on_both(pair, lambda: _chat(pair, "a"))
    assert set(under_a) == {under_a[0]} and under_a[0] != base  # the same adapter on both

    # one POST: one process loads b; both then serve it, so the other one does
    body = {"lora_name": "b", "lora_path": str(pair.dirs["b"])}
    loaded = httpx.post(pair.proc.root_url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert loaded.status_code == 200, loaded.text
    under_b = _on_both(pair, lambda: _chat(pair, "b"))  # first: a listing refreshes a P0
    assert set(under_b) == {under_b[0]} and under_b[0] not in (base, under_a[0])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # (listings are not counted)
        listed = list(pool.map(lambda _: _models(pair), range(8)))
    assert all(names == {"tiny", "a", "b"} for names in listed), listed

    unload = {"lora_name": "b"}
    unloaded = httpx.post(pair.proc.root_url + "/v1/unload_lora_adapter", json=unload, timeout=60)
    assert unloaded.status_code == 200, unloaded.text

    def gone() -> str | None:
        try:
            _chat(pair, "b")
        except openai.NotFoundError as exc:
            return exc.code
        return None

    assert set(_on_both(pair, gone)) == {"model_not_found"}
    assert set(_on_both(pair, lambda: _chat(pair, "a"))) == {under_a[0]}  # a is untouched
