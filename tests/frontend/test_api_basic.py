"""The P0 HTTP API end to end against the scripted P1: real uvicorn, real ZMQ, openai SDK."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend, image_part
from scripted_stack import scripted_stack

KEY = "sk-test"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeEngine, RunningFrontend]]:
    directory = tmp_path_factory.mktemp("p1")
    with scripted_stack(directory, api_key=KEY, ping_interval_s=0.5) as running:
        yield running


@pytest.fixture
def client(stack: tuple[FakeEngine, RunningFrontend]) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[1].base_url, api_key=KEY, timeout=30, max_retries=0)


def _messages(color: tuple[int, int, int]) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [image_part(color), {"type": "text", "text": "What is in the picture?"}],
        }
    ]


def test_chat_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="tiny", messages=_messages((200, 10, 10)), max_tokens=6, temperature=0
    )
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens > 16  # the image placeholder tokens are counted
    stream = client.chat.completions.create(
        model="tiny",
        messages=_messages((200, 10, 10)),
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 6


def test_output_depends_on_the_image(client: openai.OpenAI) -> None:
    a = client.chat.completions.create(
        model="tiny", messages=_messages((1, 2, 3)), max_tokens=5, temperature=0
    )
    b = client.chat.completions.create(
        model="tiny", messages=_messages((250, 240, 230)), max_tokens=5, temperature=0
    )
    assert a.choices[0].message.content != b.choices[0].message.content


def test_n_choices_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=_messages((5, 90, 5)), max_tokens=3, n=3, seed=7
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 3  # seeds differ per choice
    completion = client.completions.create(model="tiny", prompt="Hello, how are", max_tokens=4)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_choice_in_p0_and_aborts_it_in_p1(
    stack: tuple[FakeEngine, RunningFrontend], client: openai.OpenAI, stream: bool
) -> None:
    """P1 matches no stop strings: P0's detokenizer does, cuts the text before the match,
    answers ``finish_reason="stop"`` and aborts the request in P1 long before max_tokens."""
    prompt = f"Tell me a story ({stream})"
    free = client.completions.create(model="tiny", prompt=prompt, max_tokens=16)
    text = free.choices[0].text
    stop = text[6:8]
    expected = text[: text.index(stop)]
    aborted = len(stack[0].core.aborted)
    if stream:
        chunks = list(
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=3000, stop=[stop], stream=True
            )
        )
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=3000, stop=[stop])
        got, finish = whole.choices[0].text, whole.choices[0].finish_reason
        assert whole.usage is not None and whole.usage.completion_tokens < 100
    assert (got, finish) == (expected, "stop")
    # the choice is stopped in P1 too; the abort travels P0 -> P1 after the response ended
    deadline = time.monotonic() + 10.0
    while len(stack[0].core.aborted) == aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(stack[0].core.aborted) == aborted + 1


def test_embeddings_text_and_image(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model="tiny", input=["a red square", "a blue circle"])
    assert len(out.data) == 2 and len(out.data[0].embedding) == 8
    mm = client.embeddings.create(
        model="tiny",
        input=[image_part((10, 10, 200)), {"type": "text", "text": "a picture"}],  # type: ignore[list-item]
    )
    assert len(mm.data) == 1
    assert mm.data[0].embedding != out.data[0].embedding


def test_models_probes_metrics_and_api_key(
    client: openai.OpenAI, stack: tuple[FakeEngine, RunningFrontend]
) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    root = stack[1].root_url
    with httpx.Client(timeout=10) as http:
        assert http.get(f"{root}/health").status_code == 200
        assert http.get(f"{root}/ready").status_code == 200
        assert http.get(f"{root}/metrics").status_code == 401  # every route but the probes
        keyed = {"Authorization": f"bearer {KEY}"}  # the scheme in any case
        assert "mmis_shadow_hits_total{" in http.get(f"{root}/metrics", headers=keyed).text
        denied = http.get(f"{root}/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"
        wrong = http.get(f"{root}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack[1].base_url, api_key="bad", max_retries=0).models.list()
