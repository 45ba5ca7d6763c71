"""Issue 41, item 8: a lone surrogate is a 400 at validation, and a failed send undoes the
shadow's record.

What an attacker did: ``"\\ud800"`` (a valid JSON escape, not encodable as UTF-8) in a
message failed in the processor, and in ``stop`` failed in the wire codec *after* the image
was rendered: a 500 each time, and since the shadow had recorded the image P1 never got, the
next request with it was a drift miss and a retry — a way to push the drift rate that the
``CacheCoherent`` condition and the alerts read.

The rule: text the server cannot encode is refused where the body is parsed (a 400
``invalid_request_error`` naming the field, before any image is loaded or rendered); and if an
engine request still cannot be built or sent after its render recorded items in the shadow,
the shadow forgets them (``Renderer.forget``, ``frontend/client/recovery.py``).

Real processes: one ``mmis serve`` on the tiny model and a real HTTP client; the undo is a unit
test of the real renderer and recovery policy with a client whose send fails.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import Proc, image_url, series

from mmis.frontend.client.media import MediaLoader
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.frontend.client.processor import ModelProcessor
from mmis.frontend.client.recovery import RecoveryPolicy
from mmis.frontend.client.renderer import RenderedPrompt, Renderer, SourceItem, SourcePrompt
from mmis.frontend.config import FrontendConfig
from mmis.multimodal.cache import SenderCache
from mmis.protocol.messages import EngineCoreRequest, SamplingParams
from mmis.telemetry.metrics import MMISMetrics
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

LONE = "\ud800"
PHOTO = (180, 40, 120)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RESPONSES, EMBEDDINGS = "/v1/responses", "/v1/embeddings"
DRIFT = ("mmis_drift_misses_total", "mmis_mm_retries_total")
RENDERS = "mmis_processor_cache_queries_total"


def image_part(uuid: str | None = None) -> dict[str, Any]:
    inner: dict[str, Any] = {"url": image_url(PHOTO)}
    if uuid is not None:
        inner["uuid"] = uuid
    return {"type": "image_url", "image_url": inner}


def chat(text: str = "Describe it.", part: dict[str, Any] | None = None, **extra: Any) -> Any:
    content = [part or image_part(), {"type": "text", "text": text}]
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, **extra}
    return {**body, "messages": [{"role": "user", "content": content}]}


TOOL = {"type": "function", "function": {"name": "look", "description": "a" + LONE}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"title": LONE}}}
HOSTILE: dict[str, tuple[str, dict[str, Any], str]] = {
    "message-part": (CHAT, chat("hi " + LONE), "messages[0].content[1].text"),
    "message-string": (
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": LONE}]},
        "messages[0].content",
    ),
    "stop": (CHAT, chat(stop=["END", LONE]), "stop[1]"),
    "stop-string": (CHAT, chat(stop="\udfff"), "stop"),
    "tools": (CHAT, chat(tools=[TOOL]), "tools[0].function.description"),
    "response-format": (CHAT, chat(response_format=SCHEMA), "response_format.json_schema"),
    "uuid": (CHAT, chat(part=image_part(uuid="scan-" + LONE)), "messages[0].content[0]"),
    "prompt": (COMPLETIONS, {"model": "tiny", "prompt": LONE, "max_tokens": 2}, "prompt"),
    "responses-input": (RESPONSES, {"model": "tiny", "input": "x" + LONE}, "input"),
    "embeddings-input": (EMBEDDINGS, {"model": "tiny", "input": [LONE]}, "input[0]"),
}


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    args = ["serve", "--port", "0", "--model", str(tiny_model_dir()), "--served-model-name"]
    args += ["tiny"]
    directory = tmp_path_factory.mktemp("surrogates")
    proc = Proc("surrogate-serve", args, directory, {"OMP_NUM_THREADS": "1"}, announces=True)
    try:
        proc.wait_http("/ready", 300)
        yield proc
    finally:
        proc.stop()


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """``body`` as JSON the way most clients write it: ASCII, a lone surrogate as the valid
    escape ``\\ud800`` (httpx's own ``json=`` would fail to encode it)."""
    data = json.dumps(body).encode()
    return http.post(path, content=data, headers={"Content-Type": "application/json"})


def figures(proc: Proc) -> dict[str, float]:
    return {name: series(proc, name) for name in (*DRIFT, RENDERS)}


@pytest.mark.slow
def test_a_lone_surrogate_is_a_400_before_any_render_and_costs_no_drift(serve: Proc) -> None:
    before = figures(serve)
    with httpx.Client(base_url=serve.root_url, timeout=60) as http:
        for name, (path, body, param) in HOSTILE.items():
            answer = post(http, path, body)
            assert answer.status_code == 400, (name, answer.status_code, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error", name
            assert "lone surrogate" in error["message"], (name, error)
            assert error["param"] is not None and error["param"].startswith(param), (name, error)
        # raw surrogate bytes (Python's JSON decoder passes them through) are refused the same
        raw = ('{"model": "tiny", "prompt": "x' + LONE + '"}').encode("utf-8", "surrogatepass")
        answer = http.post(COMPLETIONS, content=raw, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
        # a surrogate PAIR is valid text (an emoji): not refused
        emoji = post(http, CHAT, chat("\ud83d\ude00"))
        assert emoji.status_code == 200, emoji.text
        assert figures(serve)[RENDERS] == before[RENDERS] + 1  # only the valid one rendered
        # the same image again: a plain shadow hit, no drift miss, no retry
        for _ in range(2):
            assert post(http, CHAT, chat("Describe it.")).status_code == 200
    after = figures(serve)
    assert {k: after[k] for k in DRIFT} == {k: before[k] for k in DRIFT}, (before, after)


# ------------------------------------------------------------------------- the undo (unit)
class FailingClient:
    """An engine client whose send fails after the render (e.g. the codec refuses a field)."""

    alive = True
    closed = False
    retry_after_s = 1

    def __init__(self) -> None:
        self.sends = 0

    async def add_requests(self, requests: Any, queue: Any) -> None:
        self.sends += 1
        raise UnicodeEncodeError("utf-8", LONE, 0, 1, "surrogates not allowed")


@pytest.fixture
async def renderer() -> AsyncIterator[Renderer]:
    processor = ModelProcessor.from_pretrained(str(tiny_model_dir()))
    shadow = SenderCache(1 << 30)
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield Renderer(
            processor,
            MediaLoader(FrontendConfig()),
            shadow,
            PendingInvalidations(shadow),
            executor,
            model_id="tiny",
            max_model_len=256,
            max_images=4,
        )


def build(rid: str, rendered: RenderedPrompt, choice: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        rid,
        rendered.token_ids,
        rendered.features[choice],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
        arrival_time=0.0,
    )


async def test_a_failed_send_undoes_the_shadows_record(renderer: Renderer) -> None:
    image = Image.new("RGB", (40, 30), PHOTO)
    text = renderer.processor.chat_prompt(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    )
    mm_hash = renderer.hash_image(image)
    source = SourcePrompt(
        renderer.processor.tokenize(text), [SourceItem(mm_hash, None, image, "p")]
    )
    client = FailingClient()
    policy = RecoveryPolicy(renderer, client, MMISMetrics("tiny"))  # type: ignore[arg-type]
    with pytest.raises(UnicodeEncodeError):
        await policy.complete(source, endpoint="chat", request_id="r", n=2, reserve=1, build=build)
    assert client.sends == 1
    # P1 never got the image: the next render must send its data, not a shadow hit
    again = await renderer.render(source, bypass=False, reserve_tokens=1)
    assert again.shadow_hits == 0 and again.processed == 1
    assert isinstance(again.features[0][0].data, dict)
    assert not renderer.pending.pending()
    # and once that one was recorded, the one after is a hit as usual
    third = await renderer.render(source, bypass=False, reserve_tokens=1)
    assert third.shadow_hits == 1 and third.features[0][0].data is None
