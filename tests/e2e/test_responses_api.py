"""``POST /v1/responses`` through the openai SDK against a real ``mmis serve`` (tiny LLaVA).

The serve (conftest's ``tiny_serve_evicting``, shared with ``test_structured_outputs``) runs
with the fault knob on (``--fault-evict-rate 1``: P1 drops every cached item before
resolving), so every repeat of an image is a drift miss that the recovery chain must
heal, as for chat (``frontend/api/serving_responses.py``). Whole and streamed: the text equals
chat's greedy answer to the same turn, the stream's events come in the documented order and
its deltas add up to the final text; limits and unsupported fields are 4xx naming them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, image_url, openai_client

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 6
URL = image_url((30, 200, 120))


@pytest.fixture(scope="module")
def served(tiny_serve_evicting: Proc) -> tuple[openai.OpenAI, str]:
    return openai_client(tiny_serve_evicting), tiny_serve_evicting.root_url


def _input() -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": URL},
                {"type": "input_text", "text": "What is in the picture?"},
            ],
        }
    ]


def _create(client: openai.OpenAI, **kw: object):  # type: ignore[no-untyped-def]
    return client.responses.create(
        model="mmis-tiny",
        input=_input(),  # type: ignore[arg-type]
        max_output_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def _retries(root: str) -> float:
    text = httpx.get(root + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("mmis_mm_retries_total{") and 'endpoint="/v1/responses"' in line
    )


def test_whole_response_is_chats_answer_and_heals_drift(served: tuple[openai.OpenAI, str]) -> None:
    client, root = served
    chat = client.chat.completions.create(
        model="mmis-tiny",
        max_tokens=TOKENS,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": URL}},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
        extra_body={"ignore_eos": True},
    )
    before = _retries(root)
    first = _create(client)  # the image is cached now; the knob drops it again
    second = _create(client)  # a shadow hit P1 no longer holds: one miss, one healed retry
    expected = chat.choices[0].message.content
    assert first.output_text == second.output_text == expected
    assert first.status == "incomplete"  # max_output_tokens ended it
    assert first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.usage is not None and first.usage.output_tokens == TOKENS
    assert first.id.startswith("resp_") and first.output[0].type == "message"
    assert _retries(root) - before >= 1


def test_stream_events_in_order_and_deltas_add_up(served: tuple[openai.OpenAI, str]) -> None:
    client, _ = served
    whole = _create(client)
    events = list(_create(client, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output_text == whole.output_text


def test_refusals_name_what_is_wrong(served: tuple[openai.OpenAI, str]) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as bad:
        _create(client, previous_response_id="resp_123")
    assert "previous_response_id" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as bad:
        _create(client, tools=[{"type": "function", "name": "f", "parameters": {}}])
    assert "tools" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(
            model="mmis-tiny",
            input=[{"role": "assistant", "content": [{"type": "input_image", "image_url": URL}]}],  # type: ignore[list-item]
        )
    assert "input_image" in str(bad.value)
