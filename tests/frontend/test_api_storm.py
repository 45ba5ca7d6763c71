"""S10 through the HTTP API: a storm of bad inputs, each a clear 4xx; nothing leaks after it.

P0 runs in SHM mode against the scripted P1 (real P1 shell, real SHM reader that acks), so
the leak check covers SHM space as well as in-flight requests and shadow entries.
"""

from __future__ import annotations

import base64
import io
import struct
import sys
import zlib
from pathlib import Path

import httpx
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend, image_data_url, image_part
from scripted_stack import StackFactory


def _png(size: tuple[int, int] = (16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _huge_header_png(width: int, height: int) -> bytes:
    """A small PNG whose IHDR claims ``width x height`` (CRC fixed so the header is valid)."""
    data = bytearray(_png())
    ihdr = 8 + 8  # signature, then length + "IHDR"
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[12 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture
def stack(tmp_path: Path, start_stack: StackFactory) -> tuple[FakeEngine, RunningFrontend, Path]:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    media_root = tmp_path / "media"
    media_root.mkdir()
    engine, frontend = start_stack(
        engine_options={"shm_dir": str(shm_dir)},
        mm_cache_type="shm",
        shm_dir=str(shm_dir),
        shm_gb=0.01,
        max_model_len=256,
        allowed_local_media_path=str(media_root),
        max_images_per_prompt=4,
    )
    return engine, frontend, media_root


def _chat_body(parts: list[dict], text: str = "Describe") -> dict:
    return {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
    }


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_s10_bad_input_storm_then_nothing_leaked(
    stack: tuple[FakeEngine, RunningFrontend, Path],
) -> None:
    engine, frontend, _ = stack
    state = frontend.state
    assert state is not None and state.shm_writer is not None
    url = frontend.base_url + "/chat/completions"
    storm = {
        "broken base64": (_chat_body([_image("data:image/png;base64,@@not-base64@@")]), 400),
        "not an image": (_chat_body([_image(_url(b"hello world, no pixels", "text/plain"))]), 400),
        "truncated png": (_chat_body([_image(_url(_png((64, 64))[:60]))]), 400),
        "20000x20000": (_chat_body([_image(_url(_huge_header_png(20000, 20000)))]), 400),
        "too many images": (
            _chat_body([image_part((i, i, i)) for i in range(5)]),
            400,
        ),
        "private url": (_chat_body([_image("http://127.0.0.1:9/cat.png")]), 403),
        "file outside root": (_chat_body([_image("file:///etc/passwd")]), 403),
        "over-long prompt": (
            _chat_body([image_part((44, 55, 66))], text="the quick brown fox " * 200),
            400,
        ),
    }
    expected_codes = {
        "too many images": "too_many_images",
        "20000x20000": "media_too_large",
        "over-long prompt": "context_length_exceeded",
        "private url": "media_forbidden",
        "file outside root": "media_forbidden",
    }
    with httpx.Client(timeout=30) as http:
        before = http.post(url, json=_chat_body([image_part((10, 20, 30))]))
        assert before.status_code == 200
        for name, (body, status) in storm.items():
            response = http.post(url, json=body)
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"], name
            assert "internal" not in error["message"], name
            if name in expected_codes:
                assert error["code"] == expected_codes[name], (name, error)
        after = http.post(url, json=_chat_body([image_part((10, 20, 30))]))
        assert after.status_code == 200
        assert (
            after.json()["choices"][0]["message"]["content"]
            == (before.json()["choices"][0]["message"]["content"])
        )
    # nothing leaked: no request in flight, the shadow holds only the accepted image (and the
    # readiness probe's), SHM space is back to zero once P1 acknowledged every descriptor
    assert state.client.num_in_flight == 0
    assert len(state.shadow) == 2
    # reclaim is lazy (on the next write): the accepted image's extent, shared again by the
    # request after the storm, is still held, and every byte still held was acknowledged
    held = state.shm_writer.stats().used
    freed = state.shm_writer.reclaim()
    assert freed > 0 and freed == held
    assert state.shm_writer.reclaim() == 0  # nothing left to free
    stats = state.shm_writer.stats()
    assert stats.outstanding_descriptors == 0
    assert stats.used == 0
    assert stats.expired_bytes == 0  # nothing had to be taken back from P1 by force
    assert stats.reclaimed_bytes >= freed
    # the same pixels are the same request: the helper is deterministic
    assert image_data_url((10, 20, 30)) == image_data_url((10, 20, 30))
    assert engine.receiver.stats().entries == 2
