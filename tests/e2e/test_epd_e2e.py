"""Encoder disaggregation end to end (issue 46): real ``mmis encoder`` processes, real
``mmis serve`` PD processes, the openai SDK.

- Two PD engines share one standalone encoder (``--encoder-urls``): their greedy answers to a
  two-image chat equal the aggregated server's (``tiny_serve``), and the same images sent to
  both are encoded once, counted on the encoder (``mmis_encoder_items_total``).
- The encoder killed under load: every request still succeeds (P0 sends the pixels, P1 encodes:
  ``mmis_encoder_fallbacks_total`` rises), and once the encoder is back the pool uses it again.
- ``mmis serve --encoders 1`` (the same layout on one machine) on Qwen2-VL (two images and a
  video) and Gemma 3 answers as the aggregated server of the same model does, every item
  through the encoder (``mmis_encoder_requests_total{outcome="ok"}``), no fallback; its
  encoder SIGKILLed, the next request still succeeds and the restarted encoder is used again.

The checks of a bad encoder output (shape, dtype, NaN, mislabelled) are in
``tests/engine/test_encoder_inputs.py`` (P1) and ``tests/frontend/test_encoder_pool.py`` (P0).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import itertools
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from photos import jpeg
from procs import (
    ONE_ENGINE_THREAD,
    Proc,
    children,
    family_flags,
    openai_client,
    series,
    wait_for,
)
from test_video import data_url, mp4

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _image(width: int, height: int) -> dict[str, Any]:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg(width, height)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(client: openai.OpenAI, model: str, parts: list[dict[str, Any]]) -> str:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    return str(out.choices[0].message.content)


def _encoder_series(encoder: Proc, name: str, **labels: str) -> float:
    return series(encoder, name, **labels)


FAMILIES = ("qwen2-vl", "gemma3")


@dataclasses.dataclass
class Stack:
    """Every process of this module, started side by side (they load in parallel: the
    module's setup is the slowest start, not the sum): one standalone encoder and two PD
    ``mmis serve`` on the tiny LLaVA, and per family one ``mmis serve --encoders 1`` beside
    the session's aggregated server of the family (``conftest.family_serve``, the same
    flags)."""

    encoder: Proc
    pd: tuple[Proc, Proc]
    families: dict[str, tuple[Proc, Proc]]  # family -> (aggregated, E/PD)


def _serve(tmp: pytest.TempPathFactory, name: str, *flags: str) -> Proc:
    """A ``mmis serve`` launched (its address read), not waited for."""
    return Proc(
        name, ["serve", "--port", "0", *flags], tmp.mktemp(name), ONE_ENGINE_THREAD, announces=True
    )


def _encoder(tmp: pytest.TempPathFactory) -> Proc:
    port, health = _free_port(), _free_port()
    args = ["encoder", "--model", str(tiny_model_dir()), "--threads", "1"]
    args += ["--endpoint", f"tcp://127.0.0.1:{port}", "--health-port", str(health)]
    proc = Proc("encoder", args, tmp.mktemp("encoder"), ONE_ENGINE_THREAD)
    proc.root_url = f"http://127.0.0.1:{health}"
    proc.endpoint = f"tcp://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, family_serve: Callable[[str], Proc]
) -> Iterator[Stack]:
    procs: list[Proc] = []
    launched: list[concurrent.futures.Future[Proc]] = []
    try:
        encoder = _encoder(tmp_path_factory)
        procs.append(encoder)
        llava: tuple[str, ...] = ("--model", str(tiny_model_dir()), "--served-model-name", "tiny")
        llava += ("--encoder-urls", encoder.endpoint)  # type: ignore[attr-defined]
        starts: list[tuple[str, tuple[str, ...]]] = [("serve-pd-a", llava), ("serve-pd-b", llava)]
        starts += [(f"serve-{f}-epd", (*family_flags(f), "--encoders", "1")) for f in FAMILIES]
        with concurrent.futures.ThreadPoolExecutor(len(starts) + len(FAMILIES)) as pool:
            launched = [pool.submit(_serve, tmp_path_factory, n, *f) for n, f in starts]
            # the aggregated references are the session's servers of the families
            # (conftest.py), loading beside this module's own if no module started them yet
            references = [pool.submit(family_serve, family) for family in FAMILIES]
            concurrent.futures.wait([*launched, *references])
        procs += [f.result() for f in launched if f.exception() is None]
        for future in launched:
            future.result()  # a launch that failed fails the setup (its log named)
        encoder.wait_http("/health", 300)
        for proc in procs[1:]:
            proc.wait_http("/ready", 300)
        pd_a, pd_b, *epds = procs[1:]
        for pd in (pd_a, pd_b, *epds):  # the encoder is live in each E/PD pool
            wait_for("encoder in the pool", lambda pd=pd: _joined(pd), 120)
        pairs = {f: (references[i].result(), epds[i]) for i, f in enumerate(FAMILIES)}
        yield Stack(encoder, (pd_a, pd_b), pairs)
    finally:
        with concurrent.futures.ThreadPoolExecutor(max(len(procs), 1)) as pool:
            list(pool.map(Proc.stop, procs))


@pytest.fixture(scope="module")
def encoder(stack: Stack) -> Proc:
    return stack.encoder


@pytest.fixture(scope="module")
def pd_pair(stack: Stack) -> tuple[Proc, Proc]:
    return stack.pd


def _joined(pd: Proc) -> bool:
    """The encoder answered P0's ping under P0's model: it is live (encoder_pool.py)."""
    return " serves EncoderKey(" in pd.log_path.read_text(errors="replace")


def test_two_pd_engines_answer_as_aggregated_and_share_one_encoding(
    encoder: Proc, pd_pair: tuple[Proc, Proc], tiny_serve: Proc
) -> None:
    parts = [_image(320, 240), _image(200, 300)]
    expected = _chat(openai_client(tiny_serve), "tiny", parts)
    fallbacks = [series(pd, "mmis_encoder_fallbacks_total") for pd in pd_pair]
    encoded = _encoder_series(encoder, "mmis_encoder_items_total", outcome="encoded")
    cached = _encoder_series(encoder, "mmis_encoder_items_total", outcome="cached")
    answers = [_chat(openai_client(pd), "tiny", parts) for pd in pd_pair]
    assert answers == [expected, expected]
    # two items, encoded once for both engines; the second engine's were cache hits
    assert _encoder_series(encoder, "mmis_encoder_items_total", outcome="encoded") == encoded + 2
    assert _encoder_series(encoder, "mmis_encoder_items_total", outcome="cached") == cached + 2
    assert [series(pd, "mmis_encoder_fallbacks_total") for pd in pd_pair] == fallbacks


def test_an_encoder_killed_under_load_loses_no_request(
    encoder: Proc, pd_pair: tuple[Proc, Proc]
) -> None:
    pd = pd_pair[0]
    client = openai_client(pd)
    before = series(pd, "mmis_encoder_fallbacks_total")

    def one(i: int) -> str:
        return _chat(client, "tiny", [_image(96 + 8 * i, 80)])

    os.kill(encoder.popen.pid, signal.SIGSTOP)  # hung: no answer, no error
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(one, range(8)))
        assert len(answers) == 8  # every request answered (the SDK raises on an error)
        assert series(pd, "mmis_encoder_fallbacks_total") >= before + 1
    finally:
        os.kill(encoder.popen.pid, signal.SIGCONT)
    ok = series(pd, "mmis_encoder_requests_total", outcome="ok")

    def used_again() -> bool:  # a new image goes through the encoder once it answers pings
        _chat(client, "tiny", [_image(64, 64 + int(time.monotonic() * 10) % 200)])
        return series(pd, "mmis_encoder_requests_total", outcome="ok") > ok

    wait_for("the encoder used again", used_again, 60)


@pytest.fixture(params=FAMILIES)
def family_pair(request: pytest.FixtureRequest, stack: Stack) -> tuple[str, Proc, Proc]:
    return (request.param, *stack.families[request.param])


def test_serve_with_encoders_answers_as_aggregated(family_pair: tuple[str, Proc, Proc]) -> None:
    family, aggregated, epd = family_pair
    parts = [_image(256, 192), _image(160, 224)]
    if family == "qwen2-vl":
        parts.append({"type": "video_url", "video_url": {"url": data_url(mp4(4, 2, seed=7))}})
    expected = _chat(openai_client(aggregated), "m", parts)
    ok = series(epd, "mmis_encoder_requests_total", outcome="ok")
    fallbacks = series(epd, "mmis_encoder_fallbacks_total")
    assert _chat(openai_client(epd), "m", parts) == expected
    assert series(epd, "mmis_encoder_requests_total", outcome="ok") > ok
    assert series(epd, "mmis_encoder_fallbacks_total") == fallbacks
    # serve's encoder child SIGKILLed: the next request still succeeds (pixels, or the
    # encoder already back), serve restarts it at the same address, and P0 uses it again
    (encoder_pid,) = [pid for pid in children(epd.popen.pid) if _is_encoder(pid)]
    os.kill(encoder_pid, signal.SIGKILL)
    _chat(openai_client(epd), "m", [_image(208, 176)])
    ok = series(epd, "mmis_encoder_requests_total", outcome="ok")
    sizes = itertools.count()

    def used_again() -> bool:  # a new image each try (the encoder may take a while to load)
        _chat(openai_client(epd), "m", [_image(96 + 8 * (next(sizes) % 200), 120)])
        time.sleep(0.5)
        return series(epd, "mmis_encoder_requests_total", outcome="ok") > ok

    wait_for("the restarted encoder used again", used_again, 120)
    assert encoder_pid not in children(epd.popen.pid)
    assert httpx.get(epd.root_url + "/ready", timeout=10).status_code == 200


def _is_encoder(pid: int) -> bool:
    try:
        return b"encoder" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
