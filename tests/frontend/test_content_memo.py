"""The content memo (``frontend/client/media/content_memo.py``) in the real renderer.

The real tiny-model processor, shadow and single worker: bytes seen before give their
``mm_hash`` (the hash of the bytes) without decoding; a render that needs the pixels decodes
them and sends exactly what a first sight sends; other bytes of the same pixels are another
item with the same tensors; a corrupt image is refused whatever the memo holds.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import numpy as np
import pytest
from PIL import Image

from mmis.frontend.client.media import MediaLoader
from mmis.frontend.client.media.content_memo import ContentMemo, EncodedImage
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.frontend.client.processor import ModelProcessor
from mmis.frontend.client.renderer import ImageRef, Renderer, SourcePrompt
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import InvalidMediaError
from mmis.frontend.state import load_processor
from mmis.multimodal.cache import SenderCache
from mmis.tiny_models.tiny_model import tiny_model_dir

from .test_processor_kwargs import settings_for


@pytest.fixture(scope="module")
def processor() -> ModelProcessor:
    return ModelProcessor.from_pretrained(str(tiny_model_dir()))


@pytest.fixture
async def renderer(processor: ModelProcessor) -> AsyncIterator[Renderer]:
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


def _photo(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _png(image: Image.Image, compress_level: int = 6) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def _url(image: Image.Image, compress_level: int = 6) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image, compress_level)).decode()


async def _prepare(r: Renderer, url: str, detail: str | None = None) -> SourcePrompt:
    prompt = r.processor.chat_prompt(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    )
    return await r.prepare(prompt, [ImageRef(url, None, "messages[0]", detail=detail)])


async def test_bytes_seen_before_give_their_hash_without_decoding(renderer: Renderer) -> None:
    image = _photo(1)
    url = _url(image)
    first = (await _prepare(renderer, url)).items[0]
    assert isinstance(first.image, Image.Image)  # a first sight decodes
    again = (await _prepare(renderer, url)).items[0]
    assert isinstance(again.image, EncodedImage)
    assert "image" not in vars(again.image)  # not decoded
    assert again.mm_hash == first.mm_hash == renderer.hash_encoded(_png(image))
    assert first.mm_hash != renderer.hash_image(image)  # bytes, not pixels
    assert (renderer.memo.hits, renderer.memo.misses) == (1, 1)


async def test_an_image_s_bytes_are_hashed_once_seen_or_not(
    renderer: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memo is keyed by the ``mm_hash`` itself: a first sight and a repeat each pass the
    bytes through the hasher once (no separate digest of the bytes for the memo's key)."""
    fed: list[int] = []
    real = blake3.blake3

    class Counting:
        """blake3.blake3, counting the bytes it is given (at construction or update)."""

        def __init__(self, data: Any = b"", /, **kwargs: Any) -> None:
            self.inner = real(**kwargs)
            self.update(data)

        def update(self, data: Any, /) -> object:
            fed.append(memoryview(data).nbytes)
            return self.inner.update(data)

        def digest(self) -> bytes:
            return bytes(self.inner.digest())

        def hexdigest(self) -> str:
            return str(self.inner.hexdigest())

    monkeypatch.setattr(blake3, "blake3", Counting)
    data = _png(_photo(6), compress_level=0)  # ~9 KB: larger than every other fed field
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for _ in range(2):  # unseen, then seen
        fed.clear()
        await _prepare(renderer, url)
        assert sum(n for n in fed if n >= len(data)) == len(data), fed


async def test_a_render_that_needs_the_pixels_sends_what_a_first_sight_sends(
    renderer: Renderer,
) -> None:
    url = _url(_photo(2))
    first = await renderer.render(await _prepare(renderer, url), bypass=False, reserve_tokens=1)
    assert first.processed == 1
    again = await _prepare(renderer, url)
    hit = await renderer.render(again, bypass=False, reserve_tokens=1)
    assert hit.shadow_hits == 1
    assert "image" not in vars(again.items[0].image)  # a shadow hit never decodes
    # P1 lost it (the retry path): the render decodes the bytes and sends the same tensors
    resent = await renderer.render(again, bypass=True, reserve_tokens=1)
    assert resent.processed == 1 and "image" in vars(again.items[0].image)
    assert resent.token_ids == first.token_ids
    sent, fresh = first.features[0][0].data, resent.features[0][0].data
    assert isinstance(sent, dict) and isinstance(fresh, dict) and sent.keys() == fresh.keys()
    for name in sent:
        np.testing.assert_array_equal(np.asarray(sent[name]), np.asarray(fresh[name]))


async def test_other_bytes_of_the_same_pixels_are_another_item_with_the_same_tensors(
    renderer: Renderer,
) -> None:
    image = _photo(3)
    fast, small = _url(image, compress_level=1), _url(image, compress_level=9)
    assert fast != small
    a = await _prepare(renderer, fast)
    b = await _prepare(renderer, small)
    assert isinstance(b.items[0].image, Image.Image)  # a memo miss: decoded and hashed
    assert a.items[0].mm_hash != b.items[0].mm_hash  # hashed as bytes (multimodal/hashing.py)
    ra = await renderer.render(a, bypass=False, reserve_tokens=1)
    rb = await renderer.render(b, bypass=False, reserve_tokens=1)
    assert (ra.processed, rb.processed) == (1, 1) and ra.token_ids == rb.token_ids
    da, db = ra.features[0][0].data, rb.features[0][0].data
    assert isinstance(da, dict) and isinstance(db, dict) and da.keys() == db.keys()
    for name in da:
        np.testing.assert_array_equal(np.asarray(da[name]), np.asarray(db[name]))


async def test_the_detail_budget_is_part_of_the_memo_key() -> None:
    processor, _ = load_processor(settings_for(tiny_model_dir("qwen2-vl-hub")))
    low_kwargs = processor.image_kwargs("low")
    assert low_kwargs != processor.image_kwargs(None)  # Qwen2-VL pins a smaller budget
    shadow = SenderCache(1 << 30)
    with ThreadPoolExecutor(max_workers=1) as executor:
        r = Renderer(
            processor,
            MediaLoader(FrontendConfig()),
            shadow,
            PendingInvalidations(shadow),
            executor,
            model_id="tiny-qwen",
            max_model_len=4096,
            max_images=4,
        )
        image = _photo(4)
        url = _url(image)
        auto = (await _prepare(r, url)).items[0]
        low = (await _prepare(r, url, detail="low")).items[0]
        assert isinstance(low.image, Image.Image)  # same bytes, other kwargs: a memo miss
        assert low.mm_hash == r.hash_encoded(_png(image), low_kwargs) != auto.mm_hash
        assert (await _prepare(r, url, detail="low")).items[0].mm_hash == low.mm_hash


async def test_corrupt_bytes_are_refused_and_never_remembered(renderer: Renderer) -> None:
    buf = io.BytesIO()
    _photo(5).save(buf, format="PNG")
    broken = "data:image/png;base64," + base64.b64encode(buf.getvalue()[:200]).decode()
    for _ in range(2):
        with pytest.raises(InvalidMediaError):
            await _prepare(renderer, broken)
    assert len(renderer.memo) == 0


def test_the_memo_is_bounded_least_recently_used_first() -> None:
    memo = ContentMemo(entries=2)
    memo.remember("h-a")
    memo.remember("h-b")
    assert memo.knows("h-a")  # a is now the most recent
    memo.remember("h-c")
    assert not memo.knows("h-b") and len(memo) == 2
    assert memo.knows("h-a") and memo.knows("h-c")
    assert (memo.hits, memo.misses) == (3, 1)
