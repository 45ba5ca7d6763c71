"""The multi-LoRA API (issue 47, Build 3) on ONE real ``mmis serve`` (tiny LLaVA, an API key,
``--lora-modules`` with two PEFT adapters of random non-zero weights: ``lm`` on the language
model only, ``tower`` also on the vision tower and projector; ``--allow-runtime-lora-updating``),
driven by the openai SDK and httpx:

- ``/v1/models`` lists both adapters with ``parent`` = the base model and ``root`` = their path;
  ``model=<adapter>`` answers differently from the base (and from the other adapter), the same
  on a repeat, and the answer names the adapter; completions and responses select it too.
  (Equality with transformers + PEFT is the engine's parity test, tests/engine/test_lora_parity.py.)
- ``POST /v1/load_lora_adapter`` loads at run time (behind the API key), the new name answers as
  the adapter of the same weights does; ``/v1/unload_lora_adapter`` of a name a live stream
  uses is a 409, then unloads, and the name is a 404 ``model_not_found`` again (unload too).
- Each bad adapter (rank over ``--max-lora-rank``, target modules the model lacks, corrupt
  weights, a missing weights file, no directory) is a 400 naming the cause, and the server keeps
  serving the base and the adapters it holds, unchanged.
- ``POST /internal/block_keys`` under an adapter names the blocks the engine then announces
  for it (``--kv-events-endpoint``, with its ``lora_id`` / ``lora_name``), keys apart from the
  base model's for the same prompt (a router matches them: docs/ROUTING.md).
- Without ``--allow-runtime-lora-updating`` (the session's ``tiny_serve``) the routes do not
  exist (404, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING) and an adapter name is a 404.
- The operator's internal routes on the operations port (``--ops-port``; the internal token
  only): ``POST /internal/load_lora_adapter`` of a hub id (``hf://org/name@rev``, read from an
  HF cache the test fills: the server runs offline) is served under its name and listed, with
  ``GET /stats/cache``'s ``lora`` naming what the engine holds; a repeat is a 200, the same name
  from another path a 409 ``lora_already_loaded``; unloading twice is a 200 each time. A hub id
  that is malformed or not to be had is a 400 naming the cause, at once.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_adapters import LM, TOWER, broken_copies, make_adapter
from procs import Proc, ServeFactory, chat_body, image_url, openai_client, wait_for
from tools import free_port

from mmis.protocol.kv_events import KV_DECODER, BlockStored
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_RANK = 8
TOKEN = "7f" * 32  # the internal token (/internal/*)
INTERNAL = {"Authorization": f"Bearer {TOKEN}"}
HUB_ID = "hf://mmis-test/lm@v1"  # lm's files in the server's HF cache (hub_cache)


class Served:
    def __init__(self, proc: Proc, dirs: dict[str, Path], replay: str, ops: str) -> None:
        self.proc = proc
        self.replay = replay  # the engine's KV-events replay endpoint
        self.ops = ops  # the operations port's root URL
        self.dirs = dirs
        self.client = openai_client(proc, api_key=KEY)
        self.http = httpx.Client(base_url=proc.root_url, headers=AUTH, timeout=60.0)

    def chat(self, model: str, color: tuple[int, int, int] = (200, 30, 90)) -> tuple[str, str]:
        """``(text, model)`` of a greedy 6-token chat with one image."""
        out = self.client.chat.completions.create(
            model=model,
            max_tokens=6,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image_url(color)}},
                        {"type": "text", "text": "What is in the picture?"},
                    ],
                }
            ],
        )
        return out.choices[0].message.content or "", out.model

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def internal(
        self, path: str, body: dict[str, Any], token: str | None = TOKEN
    ) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return httpx.post(self.ops + path, json=body, headers=headers, timeout=60.0)


def hub_cache(root: Path, repo: str, revision: str, adapter: Path) -> Path:
    """An HF hub cache under ``root`` holding ``adapter``'s files as ``repo`` at ``revision``
    (huggingface_hub's layout: ``models--org--name/{refs/<rev>, snapshots/<commit>/...}``)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in adapter.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (folder / "refs").mkdir()
    (folder / "refs" / revision).write_text(commit)
    return root


@pytest.fixture(scope="module")
def served(start_serve: ServeFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("lora-adapters")
    model = tiny_model_dir()
    dirs = {
        "lm": make_adapter(model, root / "lm", LM, rank=8, alpha=16, seed=1),
        "tower": make_adapter(
            model, root / "tower", TOWER["llava"], rank=4, alpha=8, seed=2, rslora=True
        ),
    }
    dirs |= broken_copies(dirs["lm"], root, MAX_RANK)
    flags = ["--model", str(model), "--served-model-name", "tiny", "--api-key", KEY]
    flags += ["--max-lora-rank", str(MAX_RANK), "--allow-runtime-lora-updating"]
    flags += [
        "--lora-modules",
        f"lm={dirs['lm']}",
        f'{{"name": "tower", "path": "{dirs["tower"]}"}}',
    ]
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    flags += ["--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
    ops_port = free_port()
    flags += ["--ops-port", str(ops_port)]
    env = {"OMP_NUM_THREADS": "1", "MMIS_FRONTEND_INTERNAL_TOKEN": TOKEN}
    env["HF_HUB_CACHE"] = str(hub_cache(root / "hub", "mmis-test/lm", "v1", dirs["lm"]))
    with start_serve("serve-lora", *flags, env=env) as proc:
        running = Served(proc, dirs, replay, f"http://127.0.0.1:{ops_port}")
        yield running
        running.http.close()


def test_adapters_are_listed_and_selected_by_model(served: Served) -> None:
    cards = {m.id: m.model_dump() for m in served.client.models.list().data}
    assert cards["tiny"].get("parent") is None
    for name in ("lm", "tower"):
        assert cards[name]["parent"] == "tiny"
        assert cards[name]["root"] == str(served.dirs[name])
        assert cards[name]["object"] == "model" and cards[name]["owned_by"]
    base, lm, tower = (served.chat(m) for m in ("tiny", "lm", "tower"))
    assert (base[1], lm[1], tower[1]) == ("tiny", "lm", "tower")  # answers name the adapter
    assert served.chat("lm") == lm and served.chat("tower") == tower  # a repeat: the same
    assert len({base[0], lm[0], tower[0]}) == 3, (base, lm, tower)
    done = served.client.completions.create(  # sampled: a random model may end early
        model="lm", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert done.model == "lm" and done.usage is not None and done.usage.completion_tokens == 3
    resp = served.client.responses.create(model="tower", input="hello", max_output_tokens=3)
    assert resp.model == "tower"
    with pytest.raises(openai.NotFoundError) as missing:
        served.chat("no-such-adapter")
    assert missing.value.code == "model_not_found"


def test_load_use_and_unload_at_run_time(served: Served) -> None:
    body = {"lora_name": "again", "lora_path": str(served.dirs["lm"])}
    refused = httpx.post(served.proc.root_url + "/v1/load_lora_adapter", json=body)
    assert refused.status_code == 401  # behind the API key
    loaded = served.post("/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'again' added successfully."
    assert served.post("/v1/load_lora_adapter", body).status_code == 400  # already loaded
    listed = {m.id: m for m in served.client.models.list().data}
    assert listed["again"].model_dump()["parent"] == "tiny"
    assert served.chat("again")[0] == served.chat("lm")[0]  # the same weights, the same answer

    stream = served.client.chat.completions.create(
        model="again",
        max_tokens=3000,
        stream=True,
        messages=[{"role": "user", "content": "count"}],
        extra_body={"ignore_eos": True},
    )
    with stream:
        next(iter(stream))  # the request runs under the adapter now
        busy = served.post("/v1/unload_lora_adapter", {"lora_name": "again"})
        assert busy.status_code == 409, busy.text
        assert "in use" in busy.json()["error"]["message"]
    unloaded: list[httpx.Response] = []

    def unloads() -> bool:  # the stream's abort reaches the engine shortly after the close
        unloaded.append(served.post("/v1/unload_lora_adapter", {"lora_name": "again"}))
        return unloaded[-1].status_code != 409

    wait_for("the unload after the stream ended", unloads, timeout=30)
    assert unloaded[-1].status_code == 200, unloaded[-1].text
    assert unloaded[-1].text == "Success: LoRA adapter 'again' removed successfully."
    with pytest.raises(openai.NotFoundError) as gone:
        served.chat("again")
    assert gone.value.code == "model_not_found"
    again = served.post("/v1/unload_lora_adapter", {"lora_name": "again"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    assert "again" not in {m.id for m in served.client.models.list().data}


def test_the_internal_routes_keep_the_operators_adapter_set(served: Served) -> None:
    load, unload = "/internal/load_lora_adapter", "/internal/unload_lora_adapter"
    body = {"lora_name": "synced", "lora_path": HUB_ID}
    for token in (None, KEY, "0" * 64):  # the internal token only: not the API key
        refused = served.internal(load, body, token=token)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_internal_token"
    assert served.post(load, body).status_code == 404  # on the operations port only
    loaded = served.internal(load, body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'synced' added successfully."
    card = {m.id: m.model_dump() for m in served.client.models.list().data}["synced"]
    assert card["parent"] == "tiny" and card["root"] == HUB_ID
    assert served.chat("synced") == (served.chat("lm")[0], "synced")  # lm's files, from the hub

    def held() -> list[dict[str, str]]:
        stats = httpx.get(served.ops + "/stats/cache", timeout=30)  # no token: the probe's
        assert stats.status_code == 200, stats.text
        assert {"drift_rate", "hit_rate"} <= set(stats.json())
        assert stats.json()["lora"]["max_loras"] >= 1
        adapters: list[dict[str, str]] = stats.json()["lora"]["adapters"]
        return adapters

    lm, tower = ({"name": n, "path": str(served.dirs[n])} for n in ("lm", "tower"))
    assert held() == [lm, {"name": "synced", "path": HUB_ID}, tower]  # sorted by name
    again = served.internal(load, body)  # the operator's next sync: nothing to do
    assert again.status_code == 200 and "already loaded" in again.text, again.text
    other = served.internal(load, body | {"lora_path": tower["path"]})
    assert other.status_code == 409, other.text
    assert other.json()["error"]["code"] == "lora_already_loaded"
    assert HUB_ID in other.json()["error"]["message"]
    for said in ("removed successfully", "not loaded"):  # an unload twice: 200 both times
        gone = served.internal(unload, {"lora_name": "synced"})
        assert gone.status_code == 200 and said in gone.text, gone.text
    assert held() == [lm, tower]
    with pytest.raises(openai.NotFoundError):
        served.chat("synced")


@pytest.mark.parametrize(
    ("path", "cause"),
    [
        ("hf://mmis-test/absent", "is not in the local HF cache and HF_HUB_OFFLINE is set"),
        ("hf://mmis-test/lm@v2", "is not in the local HF cache and HF_HUB_OFFLINE is set"),
        ("hf://no-org", "is not of the form hf://<org>/<name>[@<revision>]"),
    ],
)
def test_a_hub_id_that_cannot_be_had_is_a_400_naming_the_cause(
    served: Served, path: str, cause: str
) -> None:
    body = {"lora_name": "from-hub", "lora_path": path}
    answer = served.internal("/internal/load_lora_adapter", body)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert cause in message and "from-hub" in message, message
    assert answer.elapsed.total_seconds() < 5  # no retries against a hub it cannot reach


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        ("rank", f"rank {MAX_RANK * 4} exceeds --max-lora-rank {MAX_RANK}"),
        ("target", "match no projection of the model"),
        ("corrupt", "cannot read"),
        ("missing", "adapter_model.safetensors does not exist"),
        ("nowhere", "is not a directory"),
    ],
)
def test_a_bad_adapter_is_a_400_naming_the_cause_and_the_others_keep_serving(
    served: Served, case: str, cause: str
) -> None:
    before = served.chat("tower"), served.chat("tiny")
    path = served.dirs.get(case, served.dirs["lm"] / "nowhere")
    answer = served.post(
        "/v1/load_lora_adapter", {"lora_name": f"bad-{case}", "lora_path": str(path)}
    )
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert cause in message and f"bad-{case}" in message, message
    assert (served.chat("tower"), served.chat("tiny")) == before
    assert f"bad-{case}" not in {m.id for m in served.client.models.list().data}


def test_hostile_bodies_on_the_lora_routes_are_400s_and_change_nothing(served: Served) -> None:
    """Bytes from the network on the four LoRA routes (the public ones under the API key, the
    ops port's under the internal token): not JSON, random bytes, the wrong shapes, a body past
    --max-body-bytes (the gate's one bound, before any parsing). Each is a 4xx with a message;
    the adapter set and the answers are unchanged."""
    before = sorted(m.id for m in served.client.models.list().data), served.chat("lm")
    rng = random.Random(47)
    bodies: list[bytes] = [
        b"",
        b"{not json",
        bytes(rng.randrange(256) for _ in range(512)),
        b"[]",
        b'{"lora_name": 7, "lora_path": ["x"]}',
        b'{"lora_name": "", "lora_path": ""}',
        json.dumps({"lora_name": "x" * 100_000, "lora_path": "/\x00"}).encode(),
        b'{"lora_name": "' + b"a" * (64 * 1024 * 1024) + b'"}',
    ]
    routes = [
        (served.proc.root_url, "/v1/load_lora_adapter", AUTH),
        (served.proc.root_url, "/v1/unload_lora_adapter", AUTH),
        (served.ops, "/internal/load_lora_adapter", INTERNAL),
        (served.ops, "/internal/unload_lora_adapter", INTERNAL),
    ]
    for root, path, headers in routes:
        for body in bodies:
            answer = httpx.post(
                root + path,
                content=body,
                headers={**headers, "Content-Type": "application/json"},
                timeout=60.0,
            )
            assert 400 <= answer.status_code < 500, (path, body[:40], answer.text[:200])
            assert answer.json()["error"]["message"], (path, body[:40])
    after = sorted(m.id for m in served.client.models.list().data), served.chat("lm")
    assert after == before


def test_runtime_routes_do_not_exist_unless_enabled(tiny_serve: Proc) -> None:
    body = {"lora_name": "x", "lora_path": "/nowhere"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert httpx.post(tiny_serve.root_url + path, json=body).status_code == 404
    client = openai_client(tiny_serve)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="x", prompt="hi", max_tokens=1)
    assert missing.value.code == "model_not_found"


def _replayed(dealer: zmq.Socket[bytes], start: int) -> list[bytes]:
    """Every KV-event batch payload the engine buffered from sequence ``start`` on."""
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    payloads = []
    while True:
        assert dealer.poll(10_000), "no replay answer"
        frames = dealer.recv_multipart()
        if frames[2] == b"\xff" * 8:
            return payloads
        payloads.append(frames[3])


def test_block_keys_under_an_adapter_are_the_blocks_the_engine_announces(served: Served) -> None:
    body = chat_body((12, 140, 220), max_tokens=1)  # only the prompt's KV is computed

    def keys(model: str) -> dict[str, Any]:
        url = served.ops + "/internal/block_keys"
        answer = httpx.post(url, json=body | {"model": model}, headers=INTERNAL)
        assert answer.status_code == 200, answer.text
        return answer.json()

    tower, base = keys("tower"), keys("tiny")
    assert tower["block_keys"] and len(tower["block_keys"]) == len(base["block_keys"])
    assert not set(tower["block_keys"]) & set(base["block_keys"])  # keyed apart from the base
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(served.replay)
        seen = len(_replayed(dealer, 0))
        done = served.post("/v1/chat/completions", body | {"model": "tower"})
        assert done.status_code == 200, done.text
        payloads = _replayed(dealer, seen)
    finally:
        dealer.close(linger=0)
    stored = [
        e for p in payloads for e in KV_DECODER.decode(p).events if isinstance(e, BlockStored)
    ]
    assert [h.hex() for e in stored for h in e.block_hashes] == tower["block_keys"]
    assert {e.lora_name for e in stored} == {"tower"} and all(e.lora_id for e in stored)
