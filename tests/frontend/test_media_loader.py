"""MediaLoader: one entry for data:, http(s):// and file:// images, count limit first."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmis.frontend.client.media import MediaLoader, check_image_count
from mmis.frontend.client.media.fetch import MediaFetcher
from mmis.frontend.client.ssrf import SSRFGuard
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import (
    InvalidMediaError,
    MediaForbiddenError,
    MediaTooLargeError,
    TooManyImagesError,
)


def png(seed: int, size: int = 16) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(png(1))
    (root / "text.png").write_bytes(b"not an image at all")
    return root


@pytest.fixture
def http_base(media_dir: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def loader(media_dir: Path, **settings: Any) -> MediaLoader:
    values: dict[str, Any] = {
        "allowed_local_media_path": str(media_dir),
        "allow_private_media_urls": True,
    }
    values.update(settings)
    return MediaLoader(FrontendConfig(**values))


async def test_every_source_gives_the_same_image_and_original_bytes(
    media_dir: Path, http_base: str
) -> None:
    raw = (media_dir / "a.png").read_bytes()
    load = loader(media_dir)
    results = [
        await load.load_image(data_url(raw)),
        await load.load_image(f"{http_base}/a.png"),
        await load.load_image(f"file://{media_dir}/a.png"),
    ]
    await load.aclose()
    assert [r.source for r in results] == ["data", "http", "file"]
    for result in results:
        assert result.data == raw
        assert result.image.mode == "RGB"
        assert np.array_equal(np.asarray(result.image), np.asarray(Image.open(io.BytesIO(raw))))


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "a.png", "javascript:alert(1)"])
async def test_unsupported_schemes_are_a_400(media_dir: Path, url: str) -> None:
    with pytest.raises(InvalidMediaError, match="unsupported image URL"):
        await loader(media_dir).load_image(url, param="messages[0].content[0].image_url.url")


async def test_non_image_over_http_is_a_400(media_dir: Path, http_base: str) -> None:
    with pytest.raises(InvalidMediaError, match="not an image"):
        await loader(media_dir).load_image(f"{http_base}/text.png")


async def test_data_url_pixel_limit(media_dir: Path) -> None:
    with pytest.raises(MediaTooLargeError, match="pixels"):
        await loader(media_dir, media_max_pixels=100).load_image(data_url(png(2)))


async def test_file_outside_root_through_the_loader(media_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.png").write_bytes(png(3))
    with pytest.raises(MediaForbiddenError):
        await loader(media_dir).load_image(f"file://{media_dir}/../secret.png")


async def test_too_many_images_is_refused_before_any_fetch(media_dir: Path) -> None:
    lookups: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["93.184.216.34"]

    config = FrontendConfig(max_images_per_prompt=2)
    fetcher = MediaFetcher(config, guard=SSRFGuard(resolver=resolver))
    load = MediaLoader(config, fetcher=fetcher)
    urls = [f"http://img{i}.example/x.png" for i in range(3)]
    with pytest.raises(TooManyImagesError, match="3 images, more than the limit of 2") as info:
        await load.load_images(urls)
    assert info.value.status == 400
    assert lookups == []


def test_check_image_count_boundary() -> None:
    check_image_count(8, 8)
    with pytest.raises(TooManyImagesError):
        check_image_count(9, 8)


async def test_load_images_is_all_or_nothing_with_the_typed_error(media_dir: Path) -> None:
    load = loader(media_dir)
    good = data_url(png(4))
    with pytest.raises(InvalidMediaError, match="not valid base64") as info:
        await load.load_images([good, "data:image/png;base64,@@@", good], params=["i0", "i1", "i2"])
    assert info.value.param == "i1"
    images = await load.load_images([good, data_url(png(5))])
    assert [i.data for i in images] == [png(4), png(5)]


class RecordingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="media-test")
        self.calls: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(getattr(fn, "func", fn).__name__)
        return super().submit(fn, *args, **kwargs)


async def test_blocking_work_runs_in_the_executor(media_dir: Path) -> None:
    executor = RecordingExecutor()
    load = MediaLoader(FrontendConfig(allowed_local_media_path=str(media_dir)), executor=executor)
    await load.load_image(f"file://{media_dir}/a.png")
    executor.shutdown()
    assert executor.calls == ["read", "decode_sync"]
