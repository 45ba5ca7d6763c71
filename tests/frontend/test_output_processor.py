"""P0 flows one way (issue 45): ``frontend/api`` hands ``frontend/client`` data, never a
callable, and ``client`` never calls back into ``api``; the client's output processor builds
the engine requests (``n`` siblings, a seed each, the cap or the context's room).

The direction is checked at run time by the request-walk tracer's own profile hook
(``tests/e2e/walk_trace/sitecustomize.py``, loaded here as a plain module) while the real
``TextGenerator`` (api) answers whole and streamed completions through the real output
processor, recovery policy and generation (client) against a fake engine client. A self-test
shows the hook reports both kinds of crossing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, cast

from starlette.requests import Request

import mmis.frontend.client.output_processor as output_processor
from mmis.frontend.api.schemas import CompletionRequest
from mmis.frontend.api.serving_completions import CompletionFormat
from mmis.frontend.api.serving_generate import TextGenerator
from mmis.frontend.client.lora import LoRARegistry
from mmis.frontend.client.output_processor import GenerateRequest, OutputProcessor
from mmis.frontend.client.recovery import RecoveryPolicy
from mmis.frontend.client.renderer import RenderedPrompt, SourcePrompt
from mmis.protocol.messages import EngineCoreOutput, EngineCoreRequest, SamplingParams
from mmis.telemetry.metrics import MMISMetrics

ROOT = Path(__file__).resolve().parents[2]
FRONTEND = ROOT / "server" / "mmis" / "frontend"
HOOK = ROOT / "tests" / "e2e" / "walk_trace" / "sitecustomize.py"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("walk_trace_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs nothing: MMIS_WALK_TRACE is not set here
    return module


@contextmanager
def traced(api: str, client: str) -> Iterator[ModuleType]:
    """The hook's profile function on this thread, with ``api`` and ``client`` as the two
    sides (path prefixes); yields the module (its ``_SEEN`` and ``_CROSSINGS``)."""
    hook = _hook()
    hook._API, hook._CLIENT, hook._ON = api, client, True
    sys.setprofile(hook._profile)
    try:
        yield hook
    finally:
        sys.setprofile(None)


class _Client:
    """A fake engine client: each sibling answers ``ab``, ``cd`` (finished by length)."""

    alive, closed = True, False

    def __init__(self) -> None:
        self.requests: list[EngineCoreRequest] = []

    async def add_requests(self, requests: list[EngineCoreRequest], queue: Any) -> None:
        self.requests += requests
        for text, finish in (("ab", None), ("cd", "length")):
            for request in requests:
                queue.put_nowait(EngineCoreOutput(request.request_id, list(text.encode()), finish))

    async def release(self, request_ids: list[str], abort: bool) -> None:
        return None


class _Renderer:
    """A text prompt renders to itself (no items)."""

    async def render(
        self, source: SourcePrompt, *, bypass: bool, reserve_tokens: int, copies: int
    ) -> RenderedPrompt:
        return RenderedPrompt(list(source.token_ids), [[] for _ in range(copies)], 0, 0)

    def forget(self, rendered: RenderedPrompt) -> None:
        raise AssertionError("nothing failed to send")


def _decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()  # the client never disconnects
    raise AssertionError("unreachable")


def _state(client: _Client) -> Any:
    policy = RecoveryPolicy(cast(Any, _Renderer()), cast(Any, client), MMISMetrics("tiny"))
    processor = SimpleNamespace(decode=_decode, token_text=lambda t: chr(t))
    lora = LoRARegistry(cast(Any, client))  # no adapter: every request is the base model's
    return SimpleNamespace(
        processor=processor,
        policy=policy,
        max_model_len=64,
        lora=lora,
        model_name="tiny",
        served_names=("tiny",),
    )


async def _body(response: Any) -> bytes:
    if hasattr(response, "body_iterator"):
        chunks = [c async for c in cast(AsyncIterator[bytes], response.body_iterator)]
        return b"".join(chunks)
    return bytes(response.body)


async def _answer(stream: bool, client: _Client) -> bytes:
    req = CompletionRequest.model_validate(
        {"prompt": [1, 2, 3], "n": 2, "stop": ["zz"], "seed": 7, "stream": stream}
    )
    generator = TextGenerator(_state(client), "completions")
    http = Request({"type": "http"}, receive=_never)
    source = SourcePrompt([1, 2, 3], [], "prompt")
    response = await generator.respond(http, req, source, CompletionFormat("tiny"), "cmpl-r")
    return await _body(response)


async def test_api_hands_the_client_data_and_the_client_never_calls_back() -> None:
    """A whole and a streamed answer (two choices, a stop string, a seed): no callable of
    ``api`` reaches ``client``, no ``client`` frame calls ``api`` code, and both sides were
    really traced (the check cannot pass by seeing nothing)."""
    client = _Client()
    with traced(f"{FRONTEND}/api/", f"{FRONTEND}/client/") as hook:
        whole = json.loads(await _answer(False, client))
        streamed = await _answer(True, client)
    assert sorted(hook._CROSSINGS) == []
    seen = {Path(f).name for f, _ in hook._SEEN if f.startswith(str(FRONTEND))}
    assert {"serving_generate.py", "output_processor.py", "recovery.py", "generation.py"} <= seen
    assert [c["text"] for c in whole["choices"]] == ["abcd", "abcd"]
    assert streamed.count(b'"text":"ab"') == 2 and streamed.endswith(b"data: [DONE]\n\n")


async def test_the_direction_check_reports_a_callback_and_a_handed_callable() -> None:
    """The hook is not blind: with this file as the ``api`` side, a function of it handed to
    the client (as ``build`` once was) is reported, and so is the client calling it."""
    here = str(Path(__file__).resolve())
    policy = RecoveryPolicy(cast(Any, _Renderer()), cast(Any, _Client()), MMISMetrics("tiny"))

    def build(rid: str, rendered: RenderedPrompt, choice: int) -> EngineCoreRequest:
        params = SamplingParams(max_tokens=2)
        return EngineCoreRequest(rid, rendered.token_ids, [], sampling_params=params)

    with traced(here, f"{FRONTEND}/client/") as hook:
        await policy.complete(
            SourcePrompt([1], []), endpoint="x", request_id="r", n=1, reserve=1, build=build
        )
    kinds = {c.split(":")[0] for c in hook._CROSSINGS}
    assert kinds == {"api hands client a callable", "client calls api"}, hook._CROSSINGS


def _engine_request(request: GenerateRequest, prompt: int, choice: int) -> EngineCoreRequest:
    outputs = OutputProcessor(cast(Any, None), cast(Any, None), max_model_len=10)
    rendered = RenderedPrompt(list(range(prompt)), [[], [], []], 0, 0)
    return outputs.engine_request(request, f"r-{choice}", rendered, choice)


def test_each_choice_is_its_own_engine_request() -> None:
    """``n`` siblings of ``n=1``, seed + choice (mod 2**63), the cap, else the room left."""
    params = SamplingParams(n=3, seed=2**63 - 1, max_tokens=99, stop=["x"])
    capped = GenerateRequest("r", "chat", params, max_tokens=4)
    sent = [_engine_request(capped, 3, i).sampling_params for i in range(3)]
    assert [(p.n, p.seed, p.max_tokens) for p in sent if p] == [
        (1, 2**63 - 1, 4),
        (1, 0, 4),
        (1, 1, 4),
    ]
    assert params.n == 3 and params.seed == 2**63 - 1  # the request's own params are untouched
    room = GenerateRequest("r", "chat", SamplingParams(n=1), max_tokens=None)
    assert _engine_request(room, 7, 0).sampling_params.max_tokens == 3  # type: ignore[union-attr]
    assert _engine_request(room, 12, 0).sampling_params.max_tokens == 1  # type: ignore[union-attr]
    assert room.reserve == 1 and capped.reserve == 4


def test_the_detokenizer_lives_in_the_client() -> None:
    """api keeps no detokenizer of its own (one owner of stop strings)."""
    assert output_processor.IncrementalDetokenizer.__module__ == output_processor.__name__
    assert not (FRONTEND / "api" / "detokenizer.py").exists()
