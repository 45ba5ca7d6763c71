"""The renderer with the real tiny-model processor, shadow, pending set and single worker.

S6 is forced with events: a render blocks inside the processor on the worker, a second
render for a cached hash queues behind it, a miss report for that hash arrives meanwhile;
the queued render must see it before its first lookup and send the data.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from mmis.frontend.client.media import MediaLoader
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.frontend.client.processor import ModelProcessor, ProcessedImage
from mmis.frontend.client.renderer import ImageRef, Renderer, SourceItem, SourcePrompt
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import (
    ContextLengthExceededError,
    HashOnlyCacheMissError,
    InvalidRequestError,
)
from mmis.multimodal.cache import SenderCache
from mmis.shm import ShmWriter
from mmis.tiny_models.tiny_model import tiny_model_dir

WAIT = 10.0


class GatedProcessor(ModelProcessor):
    """The real processor; processing the image ``blocker`` waits for ``release``."""

    def __init__(self, inner: ModelProcessor) -> None:
        super().__init__(inner.processor, inner.processor_kwargs)
        self.blocker: Image.Image | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def process_image(self, image: Any, kwargs: Any = None) -> ProcessedImage:
        self.calls += 1
        if image is self.blocker:
            self.entered.set()
            if not self.release.wait(WAIT):
                raise TimeoutError("the test never released the blocked render")
        return super().process_image(image, kwargs)


@pytest.fixture(scope="module")
def base_processor() -> ModelProcessor:
    return ModelProcessor.from_pretrained(str(tiny_model_dir()))


@pytest.fixture
async def renderer(base_processor: ModelProcessor) -> AsyncIterator[Renderer]:
    shadow = SenderCache(1 << 30)
    executor = ThreadPoolExecutor(max_workers=1)
    r = Renderer(
        GatedProcessor(base_processor),
        MediaLoader(FrontendConfig()),
        shadow,
        PendingInvalidations(shadow),
        executor,
        model_id="tiny",
        max_model_len=256,
        max_images=4,
    )
    yield r
    r.processor.release.set()  # type: ignore[attr-defined]
    executor.shutdown(wait=True)


def _source(
    r: Renderer, image: Image.Image | None, uuid: str | None = None, bound: str = ""
) -> SourcePrompt:
    """A one-image prompt; a hash-only item (``image=None``) names the content hash its uuid
    is ``bound`` to (what ``Renderer.prepare`` resolves a uuid-only part to)."""
    text = r.processor.chat_prompt(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    )
    mm_hash = bound if image is None else r.hash_image(image)
    return SourcePrompt(r.processor.tokenize(text), [SourceItem(mm_hash, uuid, image, "p")])


def _img(color: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (40, 30), color)


async def test_s6_queued_render_sees_the_invalidation_before_its_lookup(
    renderer: Renderer,
) -> None:
    proc: GatedProcessor = renderer.processor  # type: ignore[assignment]
    cached = _source(renderer, _img((1, 2, 3)))
    first = await renderer.render(cached, bypass=False, reserve_tokens=1)
    assert first.processed == 1
    assert (await renderer.render(cached, bypass=False, reserve_tokens=1)).shadow_hits == 1
    proc.blocker = _img((9, 9, 9))
    busy = asyncio.ensure_future(
        renderer.render(_source(renderer, proc.blocker), bypass=False, reserve_tokens=1)
    )
    assert await asyncio.to_thread(proc.entered.wait, WAIT)  # the worker is now busy
    queued = asyncio.ensure_future(renderer.render(cached, bypass=False, reserve_tokens=1))
    # the output handler reports the miss (twice: duplicates coalesce) plus an unknown hash
    mm_hash = cached.items[0].mm_hash
    assert renderer.pending.enqueue([mm_hash, mm_hash]) == 1
    assert renderer.pending.enqueue(["never-cached"]) == 0
    assert renderer.pending.pending() == [mm_hash]
    # the event loop is not blocked by the busy worker: unrelated work completes
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "flowing"), WAIT) == "flowing"
    assert not queued.done()
    proc.release.set()
    await busy
    rendered = await queued
    assert rendered.shadow_hits == 0 and rendered.processed == 1  # data attached, no miss
    assert rendered.features[0][0].data is not None
    assert renderer.pending.pending() == []


async def test_rejected_request_leaves_no_shadow_entry(renderer: Renderer) -> None:
    source = _source(renderer, _img((200, 0, 0)))
    with pytest.raises(ContextLengthExceededError, match="context window of 256"):
        await renderer.render(source, bypass=False, reserve_tokens=1000)
    assert len(renderer.shadow) == 0
    await renderer.render(source, bypass=False, reserve_tokens=10)
    assert renderer.shadow.keys() == [source.items[0].mm_hash]


async def test_hash_only_item_must_be_in_the_shadow(renderer: Renderer) -> None:
    green = renderer.hash_image(_img((0, 9, 0)))
    by_uuid = _source(renderer, None, "cat-7", bound=green)
    with pytest.raises(HashOnlyCacheMissError) as err:
        await renderer.render(by_uuid, bypass=False, reserve_tokens=1)
    assert err.value.missing_uuids == ["cat-7"]
    await renderer.render(
        _source(renderer, _img((0, 9, 0)), "cat-7"), bypass=False, reserve_tokens=1
    )
    again = await renderer.render(by_uuid, bypass=True, reserve_tokens=1)
    assert again.shadow_hits == 1  # hash-only items can only be sent as hits, even on bypass


async def test_bypass_attaches_data_to_cached_items(renderer: Renderer) -> None:
    source = _source(renderer, _img((5, 5, 250)))
    await renderer.render(source, bypass=False, reserve_tokens=1)
    hit = await renderer.render(source, bypass=False, reserve_tokens=1)
    assert hit.features[0][0].data is None
    bypassed = await renderer.render(source, bypass=True, reserve_tokens=1)
    assert isinstance(bypassed.features[0][0].data, dict)
    assert bypassed.features[0][0].placeholder == hit.features[0][0].placeholder


async def test_prepare_loads_hashes_and_checks_placeholders(renderer: Renderer) -> None:
    buf = io.BytesIO()
    _img((3, 3, 3)).save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    source = await renderer.prepare(
        renderer.processor.chat_prompt(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
        ),
        [ImageRef(data_url, None, "messages[0].content[0]")],
    )
    assert len(source.items) == 1 and source.items[0].image is not None
    assert source.items[0].mm_hash == renderer.hash_encoded(buf.getvalue())
    with pytest.raises(InvalidRequestError, match="image placeholder"):
        await renderer.prepare("no image token here", [ImageRef(data_url, None, "p")])


async def test_shm_copies_issue_one_descriptor_each(
    base_processor: ModelProcessor, tmp_path: Path
) -> None:
    shadow = SenderCache(1 << 30)
    with ShmWriter(1 << 20, directory=tmp_path) as writer, ThreadPoolExecutor(1) as executor:
        r = Renderer(
            base_processor,
            MediaLoader(FrontendConfig()),
            shadow,
            PendingInvalidations(shadow),
            executor,
            model_id="tiny",
            max_model_len=256,
            max_images=4,
            shm_writer=writer,
        )
        source = _source(r, _img((77, 1, 1)))
        rendered = await r.render(source, bypass=False, reserve_tokens=1, copies=3)
        addresses = [copy[0].data for copy in rendered.features]
        assert len({id(a) for a in addresses}) >= 1 and all(a == addresses[0] for a in addresses)
        assert writer.stats().outstanding_descriptors == 3
        hit = await r.render(source, bypass=False, reserve_tokens=1)
        assert hit.features[0][0].data == addresses[0]  # the hit re-issues the descriptor
        assert writer.stats().outstanding_descriptors == 4


async def test_keys_process_an_image_once_and_change_nothing(renderer: Renderer) -> None:
    """A router's repeated key request (POST /internal/block_keys) reuses the placeholder
    length learnt the first time, even when the shadow never held the item."""
    proc: GatedProcessor = renderer.processor  # type: ignore[assignment]
    source = _source(renderer, _img((4, 5, 6)))
    before = proc.calls
    first = await renderer.keys(source, 4)
    assert proc.calls == before + 1
    assert await renderer.keys(source, 4) == first
    assert proc.calls == before + 1  # the second request ran no processor
    assert renderer.shadow.get(source.items[0].mm_hash) is None  # keys change no cache
    rendered = await renderer.render(source, bypass=False, reserve_tokens=1)
    assert rendered.num_tokens == first[0]  # the keys' prompt is the prompt P1 gets
