"""P0's LoRA registry (``frontend/client/lora.py``) against a fake engine that answers the LoRA
utility calls as ``engine/core.py`` and ``engine/lora/manager.py`` do: it raises the engine's
own typed refusals (``engine/lora/errors.py``: an id used before, a name already loaded, an
adapter in use) and answers them as ``engine/core_process.py`` does (``utility_error``: the
wire code and message), read back by the engine client's ``UtilityCallError.from_wire``. The
real engine's answers are the e2e test's (tests/e2e/test_lora_api.py); here what one real
server cannot show:

- ``--api-servers`` siblings share the engine's adapters: one loaded through one P0 resolves in
  another with the engine's id; siblings never pick the same id, and no id is reused after an
  unload, nor after a P0 restart (an id the engine says was used is skipped);
- a sibling's unload (or reload under a new id) is healed where it shows: the engine refuses
  this P0's stale request, the generation looks the adapter up again and sends it once more
  under the engine's id, or answers the 404 of an unknown model when it is gone;
- after the engine restarts, every adapter this P0 knew is loaded again under its id;
- ``--lora-modules``: loaded at start-up, adopted when the engine already holds the name, and a
  bad one (or an engine without ``--enable-lora``) is a one-line StartupError naming it;
- the flag takes vLLM's ``NAME=PATH ...`` words and its JSON form;
- P0 reads a refusal's code, never its text: an engine whose messages say something else
  gets the same answers;
- the operator's loads and unloads (the internal routes) reconcile against the engine's list,
  whichever sibling changed it: the same name and path again is nothing to do, another path a
  409, an unload of a name not held nothing to do;
- a hub id ``hf://org/name[@rev]`` is parsed (bad forms a 400 that never reaches the engine),
  and a hub that cannot be reached is a 400 naming the cause at once.
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
from starlette.requests import Request

from mmis.config import ConfigError, StartupError, add_flags, settings_from_args
from mmis.engine.core_process import UnknownUtilityError, utility_error
from mmis.engine.lora.errors import (
    LoRAAlreadyLoadedError,
    LoRAError,
    LoRAIdMismatchError,
    LoRAIdReusedError,
    LoRAInUseError,
    LoRANotLoadedError,
    LoRARankError,
)
from mmis.frontend.api.schemas import CompletionRequest
from mmis.frontend.api.serving_completions import CompletionFormat
from mmis.frontend.api.serving_generate import TextGenerator
from mmis.frontend.client.engine_client import UtilityCallError
from mmis.frontend.client.lora import (
    LoRAAdapterError,
    LoRAConflictError,
    LoRANotFoundError,
    LoRARegistry,
)
from mmis.frontend.client.lora import LoRAInUseError as P0InUseError
from mmis.frontend.client.lora_hub import HubSource, HubSourceError, parse_hub_source
from mmis.frontend.client.output_processor import Completion, GenerateRequest, TokenUsage
from mmis.frontend.client.renderer import SourcePrompt
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import from_request_error

_E = TypeVar("_E", bound=Exception)


def _reworded(exc: _E) -> _E:
    """``exc`` under the same class with a message sharing no word with the engine's."""
    return type(exc)(f"refused ({type(exc).__name__})")


class FakeLoRAEngine:
    """The engine's three LoRA utility calls (``enabled=False``: an engine without them);
    ``reword``: every refusal keeps its class (its code) but says something else."""

    def __init__(self, *, enabled: bool = True, reword: bool = False) -> None:
        self.enabled, self.reword = enabled, reword
        self.registered: dict[str, tuple[int, str]] = {}
        self.used: set[int] = set()
        self.live: set[str] = set()  # adapters a running request uses
        self.id_refusals = 0  # loads refused for an id used before

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        try:
            return self._call(method, *args)
        except (LoRAError, UnknownUtilityError) as exc:  # as core_process._answer answers it
            refusal = _reworded(exc) if self.reword else exc
            raise UtilityCallError.from_wire(utility_error(method, refusal)) from None

    def _call(self, method: str, *args: Any) -> Any:
        if not self.enabled or method not in (
            "load_lora_adapter",
            "unload_lora_adapter",
            "list_lora_adapters",
        ):
            raise UnknownUtilityError(f"unknown utility method {method!r}")
        if method == "list_lora_adapters":
            return [
                {"name": n, "lora_id": i, "path": p, "tower": False}
                for n, (i, p) in self.registered.items()
            ]
        if method == "unload_lora_adapter":
            (name,) = args
            if name in self.live:
                raise LoRAInUseError(f"LoRA adapter {name!r} is in use by 1 request(s)")
            if name not in self.registered:
                raise LoRANotLoadedError(f"LoRA adapter {name!r} is not loaded")
            del self.registered[name]
            return True
        name, lora_id, path = args
        if name in self.registered:
            raise LoRAAlreadyLoadedError(f"LoRA adapter {name!r} is already loaded")
        if lora_id < 1 or lora_id in self.used:
            self.id_refusals += 1
            raise LoRAIdReusedError(
                f"LoRA adapter {name!r}: id {lora_id} is not positive or was used before "
                "(prefix-cache blocks are keyed by it: protocol/block_keys.py)"
            )
        if path.startswith("/bad"):
            raise LoRARankError(f"LoRA adapter {name!r}: rank 64 exceeds --max-lora-rank 16")
        self.registered[name] = (lora_id, path)
        self.used.add(lora_id)
        return {"name": name, "lora_id": lora_id, "tower": False}


def _registry(engine: FakeLoRAEngine, *modules: str, index: int = 0, stride: int = 1) -> Any:
    return LoRARegistry(engine, modules, index=index, stride=stride)  # type: ignore[arg-type]


async def test_siblings_share_the_engines_adapters_and_never_reuse_an_id() -> None:
    engine = FakeLoRAEngine()
    a, b = _registry(engine, index=0, stride=2), _registry(engine, index=1, stride=2)
    await a.start()
    await b.start()
    x = await a.load("x", "/x")
    y = await b.load("y", "/y")  # b has not heard of x: its own id sequence, another id
    assert engine.id_refusals == 0 and x.lora_id != y.lora_id
    assert (await b.resolve("x")) is not None and b.get("x").lora_id == x.lora_id
    await a.unload("x")
    x2 = await a.load("x", "/x")
    ids = [x.lora_id, y.lora_id, x2.lora_id]
    assert len(set(ids)) == 3, ids
    assert engine.registered["x"][0] == x2.lora_id
    restarted = _registry(engine, index=0, stride=2)  # P0 0 again: its sequence starts over
    await restarted.start()  # adopts x and y (the engine's list) ...
    z = await restarted.load("z", "/z")  # ... and picks an id above theirs, never a used one
    assert z.lora_id not in ids and engine.registered["z"][0] == z.lora_id
    b.forget("x")  # stale (a's unload and reload): asked again, b gets the engine's new id
    assert (await b.resolve("x")) is not None and b.get("x").lora_id == x2.lora_id
    await a.unload("y")
    await b.refresh()  # the engine dropped y: so does every sibling that asks
    assert b.get("y") is None and await b.resolve("y") is None


async def test_an_id_used_before_is_skipped() -> None:
    engine = FakeLoRAEngine()
    engine.used |= {1, 2}  # a previous P0 loaded and unloaded two adapters
    registry = _registry(engine)
    await registry.start()
    assert (await registry.load("x", "/x")).lora_id == 3


async def test_refusals_are_typed_and_name_the_cause() -> None:
    engine = FakeLoRAEngine()
    registry = _registry(engine, "a=/a")
    await registry.start()
    with pytest.raises(LoRAAdapterError, match="rank 64 exceeds") as bad:
        await registry.load("b", "/bad")
    assert bad.value.status == 400 and not bad.value.message.startswith("load_lora_adapter")
    assert registry.get("b") is None and "b" not in engine.registered
    with pytest.raises(LoRAAdapterError, match="already been loaded"):
        await registry.load("a", "/a")
    engine.live.add("a")
    with pytest.raises(P0InUseError, match="in use") as busy:
        await registry.unload("a")
    assert busy.value.status == 409 and registry.get("a") is not None
    engine.live.clear()
    await registry.unload("a")
    with pytest.raises(LoRANotFoundError) as gone:
        await registry.unload("a")
    assert (gone.value.status, gone.value.code) == (404, "model_not_found")


async def test_lora_modules_at_start_up() -> None:
    engine = FakeLoRAEngine()
    engine.registered["held"] = (7, "/held")  # a sibling loaded it first
    registry = _registry(engine, "held=/held", '{"name": "new", "path": "/new"}')
    await registry.start()
    assert [a.name for a in registry.adapters()] == ["held", "new"]
    assert registry.get("held").lora_id == 7 and registry.get("new").lora_id > 7
    with pytest.raises(StartupError) as bad:
        await _registry(FakeLoRAEngine(), "ok=/ok", "broken=/bad/one").start()
    assert str(bad.value) == (
        "--lora-modules broken=/bad/one: LoRA adapter 'broken': rank 64 exceeds --max-lora-rank 16"
    )
    with pytest.raises(StartupError, match="the engine runs without --enable-lora"):
        await _registry(FakeLoRAEngine(enabled=False), "a=/a").start()
    plain = _registry(FakeLoRAEngine(enabled=False))  # no adapters asked for: nothing to say
    await plain.start()
    assert not plain.enabled and await plain.resolve("a") is None


async def test_the_engine_restarted_gets_every_known_adapter_again() -> None:
    engine = FakeLoRAEngine()
    registry = _registry(engine, "a=/a", "b=/b")
    await registry.start()
    before = {n: (a.lora_id, a.path) for n, a in ((a.name, a) for a in registry.adapters())}
    engine.registered.clear()  # a new engine process: no adapter, no id used
    engine.used.clear()
    registry.engine_restarted()
    assert registry._reload is not None
    await registry._reload
    assert engine.registered == before


class _Outputs:
    """The output processor's ``complete`` as the engine answers a request under an adapter:
    refused when its adapter is not loaded there or has another id (``LoRAManager.refusal``'s
    typed errors, on the wire as ``core.py`` sends them)."""

    def __init__(self, engine: FakeLoRAEngine) -> None:
        self.engine = engine
        self.sent: list[tuple[str | None, int]] = []

    async def complete(self, source: SourcePrompt, request: GenerateRequest) -> Completion:
        self.sent.append((request.lora_name, request.lora_id))
        name = request.lora_name
        if name is None:  # the base model's: always served
            return Completion([], TokenUsage(1, 0, 0))
        held = self.engine.registered.get(name)
        why: LoRAError | None = None
        if held is None:
            why = LoRANotLoadedError(f"LoRA adapter {name!r} is not loaded")
        elif held[0] != request.lora_id:
            why = LoRAIdMismatchError(
                f"LoRA adapter {name!r} has id {held[0]}, not {request.lora_id}"
            )
        if why is not None:
            raise from_request_error((_reworded(why) if self.engine.reword else why).to_wire())
        return Completion([], TokenUsage(1, 0, 0))


def _generator(registry: Any) -> TextGenerator:
    """A completions generator of a P0 serving base model ``m`` with ``registry``'s adapters."""
    state = SimpleNamespace(
        policy=None,
        processor=None,
        max_model_len=64,
        lora=registry,
        model_name="m",
        served_names=("m",),
    )
    return TextGenerator(state, "completions")  # type: ignore[arg-type]


async def _never() -> dict[str, Any]:
    raise AssertionError("the request was not expected to read its body")


async def test_a_stale_adapter_is_looked_up_again_once() -> None:
    engine = FakeLoRAEngine()
    a, b = _registry(engine, index=0, stride=2), _registry(engine, index=1, stride=2)
    await a.start()
    await b.start()
    x = await a.load("x", "/x")
    assert await b.resolve("x") is not None  # b serves x under x's id
    await a.unload("x")  # a sibling unloads and reloads it: a new id
    x2 = await a.load("x", "/x")
    gen = _generator(b)
    outputs = _Outputs(engine)
    gen.outputs = outputs  # type: ignore[assignment]
    req = CompletionRequest.model_validate({"model": "x", "prompt": [1], "max_tokens": 1})
    http = Request({"type": "http"}, receive=_never)
    source, fmt = SourcePrompt([1], [], "prompt"), CompletionFormat("x")
    answer = await gen.respond(http, req, source, fmt, "cmpl-1")
    assert answer.status_code == 200
    assert outputs.sent == [("x", x.lora_id), ("x", x2.lora_id)]
    await a.unload("x")  # now gone: the 404 of an unknown model, after one look
    with pytest.raises(LoRANotFoundError) as gone:
        await gen.respond(http, req, source, fmt, "cmpl-2")
    assert (gone.value.status, gone.value.code) == (404, "model_not_found")
    assert outputs.sent[2:] == [("x", x2.lora_id)] and b.get("x") is None


async def test_an_adapter_unloaded_after_its_route_resolved_it_is_a_404_not_the_base() -> None:
    """The route resolves ``model`` (``api_server.parse``) before the media load; an unload in
    between (here, or a sibling's seen by a concurrent request's stale answer, which forgets
    it) must not turn the request into the base model's: the engine is asked and says gone."""
    engine = FakeLoRAEngine()
    a, b = _registry(engine, index=0, stride=2), _registry(engine, index=1, stride=2)
    await a.start()
    await b.start()
    await a.load("x", "/x")
    assert await b.resolve("x") is not None  # the route's check passed on b
    await a.unload("x")  # a sibling unloads it ...
    b.forget("x")  # ... and a concurrent request's stale answer made b forget it
    gen = _generator(b)
    gen.outputs = outputs = _Outputs(engine)  # type: ignore[assignment]
    req = CompletionRequest.model_validate({"model": "x", "prompt": [1], "max_tokens": 1})
    http = Request({"type": "http"}, receive=_never)
    with pytest.raises(LoRANotFoundError) as gone:
        await gen.respond(http, req, SourcePrompt([1], [], "prompt"), CompletionFormat("x"), "c")
    assert (gone.value.status, gone.value.code) == (404, "model_not_found")
    assert outputs.sent == []  # nothing went to the engine, under no adapter or any
    base = CompletionRequest.model_validate({"model": "m", "prompt": [1], "max_tokens": 1})
    answer = await gen.respond(
        http, base, SourcePrompt([1], [], "prompt"), CompletionFormat("m"), "d"
    )
    assert answer.status_code == 200 and outputs.sent == [(None, 0)]


async def test_p0_reads_the_refusals_codes_not_their_texts() -> None:
    """Every refusal worded otherwise (same class, same code): the same answers."""
    engine = FakeLoRAEngine(reword=True)
    engine.used.add(1)  # lora_id_reused: the next id is tried
    a, b = _registry(engine, "x=/x"), _registry(engine, index=1, stride=2)
    await a.start()
    await b.start()
    assert a.get("x").lora_id == 2 and engine.id_refusals == 1
    engine.registered["y"] = (9, "/y")  # lora_already_loaded: a sibling's, adopted
    with pytest.raises(LoRAAdapterError, match=r"refused \(LoRAAlreadyLoadedError\)"):
        await a.load("y", "/y")
    assert a.get("y").lora_id == 9
    engine.live.add("x")  # lora_in_use: the 409, its message the engine's
    with pytest.raises(P0InUseError, match=r"^refused \(LoRAInUseError\)$") as busy:
        await a.unload("x")
    assert busy.value.status == 409
    engine.live.clear()
    await b.resolve("x")  # b knows x under id 2
    await a.unload("x")
    with pytest.raises(LoRANotFoundError):  # lora_not_loaded: the 404
        await a.unload("x")
    await a.load("x", "/x")  # x again, under a new id: b's entry is stale
    gen = _generator(b)
    gen.outputs = outputs = _Outputs(engine)  # type: ignore[assignment]
    req = CompletionRequest.model_validate({"model": "x", "prompt": [1], "max_tokens": 1})
    http = Request({"type": "http"}, receive=_never)
    source, fmt = SourcePrompt([1], [], "prompt"), CompletionFormat("x")
    answer = await gen.respond(http, req, source, fmt, "cmpl-1")  # lora_id_mismatch: resent
    assert answer.status_code == 200 and [i for _, i in outputs.sent] == [2, a.get("x").lora_id]
    await a.unload("x")
    with pytest.raises(LoRANotFoundError):  # lora_not_loaded for a request: looked up, the 404
        await gen.respond(http, req, source, fmt, "cmpl-2")
    with pytest.raises(StartupError, match="without --enable-lora"):  # unknown_utility
        await _registry(FakeLoRAEngine(enabled=False, reword=True), "a=/a").start()


def test_the_flag_takes_vllm_words_and_json() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, FrontendConfig)
    args = parser.parse_args(
        ["--lora-modules", "a=/p/a", '{"name": "b", "path": "/p/b,c"}', "--port", "1"]
    )
    settings = settings_from_args(FrontendConfig, "FRONTEND", args)
    assert settings.lora_modules == ("a=/p/a", '{"name": "b", "path": "/p/b,c"}')
    for bad in (("a",), ("a=/x", "a=/y"), ('{"name": "a"}',)):
        with pytest.raises(ConfigError, match="--lora-modules"):
            FrontendConfig(lora_modules=bad)
    with pytest.raises(ConfigError, match="names the served model"):
        FrontendConfig(model="m", lora_modules=("m=/x",))


async def test_the_operators_loads_and_unloads_reconcile() -> None:
    engine = FakeLoRAEngine()
    a, b = _registry(engine, index=0, stride=2), _registry(engine, index=1, stride=2)
    await a.start()
    await b.start()
    assert await b.ensure_loaded("x", "/x") is True
    assert await a.ensure_loaded("x", "/x") is False  # a sibling loaded it: nothing to do
    assert engine.registered["x"][0] == b.get("x").lora_id
    with pytest.raises(LoRAConflictError, match="already loaded from /x, not from /y") as other:
        await a.ensure_loaded("x", "/y")
    assert (other.value.status, other.value.code) == (409, "lora_already_loaded")
    await b.unload("x")  # a's entry is stale now: the engine's list decides
    assert await a.ensure_loaded("x", "/x") is True and "x" in engine.registered
    engine.live.add("x")
    with pytest.raises(P0InUseError):
        await b.ensure_unloaded("x")
    engine.live.clear()
    assert await b.ensure_unloaded("x") is True  # b had not heard of a's load
    assert await a.ensure_unloaded("x") is False and "x" not in engine.registered
    with pytest.raises(LoRAAdapterError, match="without --enable-lora"):
        await _registry(FakeLoRAEngine(enabled=False)).ensure_loaded("x", "/x")


def test_hub_ids_are_parsed() -> None:
    assert parse_hub_source("/adapters/sql") is None  # a directory: not a hub id
    assert parse_hub_source("hf://org/name") == HubSource("org/name")
    assert parse_hub_source("hf://Org-1/my_adapter.v2@v1.0") == HubSource(
        "Org-1/my_adapter.v2", "v1.0"
    )
    assert parse_hub_source("hf://org/name@refs/pr/3") == HubSource("org/name", "refs/pr/3")
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert str(parse_hub_source(f"hf://org/name@{sha}")) == f"hf://org/name@{sha}"
    for bad in (
        "hf://",
        "hf://name",
        "hf://org/",
        "hf://org/name/extra",
        "hf://org/name@",
        "hf://org/name@a@b",
        "hf://org/na me",
        "hf://org/name@../x",
        "hf://-org/name",
        "hf://org--x/name",
        "hf:///org/name",
    ):
        with pytest.raises(HubSourceError, match="is not of the form hf://<org>/<name>"):
            parse_hub_source(bad)


async def test_a_bad_or_unreachable_hub_id_is_a_400_that_never_reaches_the_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    with socket.socket() as closed:  # a port nobody listens on: the connection is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    engine = FakeLoRAEngine()
    registry = _registry(engine)
    await registry.start()
    with pytest.raises(LoRAAdapterError, match="'h': 'hf://solo' is not of the form") as bad:
        await registry.load("h", "hf://solo")
    assert bad.value.status == 400 and bad.value.param == "lora_path"
    started = time.monotonic()
    with pytest.raises(LoRAAdapterError, match="unreachable") as down:
        await registry.load("h", "hf://org/name@v1")
    assert time.monotonic() - started < 5  # one attempt, no retries
    assert "LoRA adapter 'h': hf://org/name@v1 could not be fetched" in down.value.message
    assert "not in the local HF cache" in down.value.message
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(LoRAAdapterError, match="HF_HUB_OFFLINE is set"):
        await registry.load("h", "hf://org/name")
    assert engine.registered == {} and registry.get("h") is None
