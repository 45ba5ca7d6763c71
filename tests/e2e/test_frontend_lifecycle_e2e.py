"""``mmis frontend`` as a process: env settings, API key, and SIGTERM draining in-flight work.

The request in flight at SIGTERM is greedy and runs past end-of-sequence to ``max_tokens``
(``ignore_eos``), so its one right answer is known: the same request answered before the
signal. Drained, it must end 200 with that exact text and ``finish_reason`` ``length``; an
answer cut short by the drain, whatever its finish_reason, differs from it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Engine, Frontend, Launcher, chat_body

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

# seconds of decoding: the signal goes the moment the request is seen in P1 (1500 before, the
# same proof with three times the decoding)
LONG_TOKENS = 600


def _long_body() -> dict[str, object]:
    """Greedy (temperature 0) and to ``max_tokens`` whatever the model samples: one answer."""
    body = chat_body((90, 30, 160), max_tokens=LONG_TOKENS)
    body["ignore_eos"] = True
    return body


@pytest.fixture
def stack(launch: Launcher) -> tuple[Engine, Frontend]:
    engine = launch.engine("engine")
    env = {"MMIS_FRONTEND_API_KEY": "sk-env"}
    # a drain bound the long request fits even on a crowded machine: this test is about the
    # request completing (work that outlasts the grace: tests/security/test_termination.py)
    return engine, launch.frontend("frontend", engine, "--graceful-shutdown-s", "300", env=env)


def test_api_key_from_env_and_sigterm_drains_in_flight_requests(
    stack: tuple[Engine, Frontend],
) -> None:
    _, frontend = stack
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=frontend.base_url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=frontend.base_url, api_key="sk-env", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    url, headers = frontend.base_url + "/chat/completions", {"Authorization": "Bearer sk-env"}

    # the reference: the same request, uninterrupted
    reference = httpx.post(url, json=_long_body(), headers=headers, timeout=300)
    assert reference.status_code == 200, reference.text
    expected = reference.json()
    assert expected["choices"][0]["finish_reason"] == "length", expected["choices"][0]
    assert expected["usage"]["completion_tokens"] == LONG_TOKENS, expected["usage"]

    result: dict[str, object] = {}

    def long_request() -> None:
        try:
            response = httpx.post(url, json=_long_body(), headers=headers, timeout=300)
            result["status"] = response.status_code
            result["body"] = response.json()
        except Exception as exc:  # reported by the assertions below
            result["error"] = exc

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 60
    while frontend.metric("engine_requests_in_flight") < 1:  # observed, not assumed
        assert time.monotonic() < deadline, "the long request never reached the engine"
        assert worker.is_alive(), result
    frontend.popen.send_signal(signal.SIGTERM)
    worker.join(300)
    assert result.get("status") == 200, result
    body = result["body"]
    assert isinstance(body, dict)
    drained = body["choices"][0]
    assert drained["finish_reason"] == "length", drained
    assert body["usage"]["completion_tokens"] == LONG_TOKENS, body["usage"]
    assert drained["message"]["content"] == expected["choices"][0]["message"]["content"], (
        "the drained answer differs from the uninterrupted one"
    )
    assert frontend.popen.wait(60) == 0
