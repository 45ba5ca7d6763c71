"""The renderer with video items, on the real tiny Qwen2-VL (and LLaVA) processors: a video's
placeholder run is the processor's own count of video tokens, in prompt order with images;
a resend is a shadow hit; the hash covers the sampled rate; the video count limit and a model
without a video token are 400s before anything is decoded."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from mmis.frontend.client.media import DecodedVideo, MediaLoader
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.frontend.client.processor import ModelProcessor
from mmis.frontend.client.renderer import VIDEO, ImageRef, Renderer
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import InvalidRequestError, TooManyImagesError
from mmis.multimodal.cache import SenderCache
from mmis.tiny_models.tiny_model import tiny_model_dir


def mp4_url(num_frames: int = 8, fps: int = 4, size: int = 64) -> str:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = np.full((size, size, 3), 20 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def png_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def make(family: str) -> AsyncIterator[Renderer]:
    shadow = SenderCache(1 << 30)
    executor = ThreadPoolExecutor(max_workers=1)
    renderer = Renderer(
        ModelProcessor.from_pretrained(str(tiny_model_dir(family))),
        MediaLoader(FrontendConfig()),
        shadow,
        PendingInvalidations(shadow),
        executor,
        model_id=family,
        max_model_len=1024,
        max_images=4,
    )
    yield renderer
    executor.shutdown(wait=True)


@pytest.fixture
async def qwen() -> AsyncIterator[Renderer]:
    async for renderer in make("qwen2-vl"):
        yield renderer


def prompt(renderer: Renderer, kinds: list[str]) -> str:
    parts = [{"type": kind} for kind in kinds] + [{"type": "text", "text": "Describe."}]
    return renderer.processor.chat_prompt([{"role": "user", "content": parts}])


VIDEO_REF = ImageRef(mp4_url(), None, "messages[0].content[0]", modality=VIDEO)
IMAGE_REF = ImageRef(png_url(), None, "messages[0].content[1]")


async def test_a_video_and_an_image_render_in_prompt_order(qwen: Renderer) -> None:
    proc = qwen.processor
    source = await qwen.prepare(prompt(qwen, ["video", "image"]), [VIDEO_REF, IMAGE_REF])
    out = await qwen.render(source, bypass=False, reserve_tokens=8)
    [video, picture] = out.features[0]
    assert (video.modality, picture.modality) == ("video", "image")
    assert isinstance(source.items[0].image, DecodedVideo)
    counted = proc.process_video(source.items[0].image).num_tokens
    assert video.placeholder.length == counted == 2 * 16  # 4 frames of 64x64: 2 patches
    ids = out.token_ids
    lo, n = video.placeholder.offset, video.placeholder.length
    assert ids[lo : lo + n] == [proc.video_token_id] * n
    assert ids.count(proc.video_token_id) == n
    assert ids[picture.placeholder.offset] == proc.image_token_id
    assert video.data is not None and "pixel_values_videos" in video.data
    again = await qwen.render(
        await qwen.prepare(prompt(qwen, ["video"]), [VIDEO_REF]), bypass=False, reserve_tokens=8
    )
    assert again.shadow_hits == 1 and again.features[0][0].data is None
    assert again.features[0][0].mm_hash == video.mm_hash


async def test_the_hash_covers_the_sampled_rate(qwen: Renderer) -> None:
    frames = np.zeros((4, 64, 64, 3), dtype=np.uint8)
    a = qwen.hash_video(DecodedVideo(frames, 2.0, 2.0), {})
    b = qwen.hash_video(DecodedVideo(frames, 1.0, 4.0), {})
    assert a != b


async def test_too_many_videos_and_no_video_token_are_400s(qwen: Renderer) -> None:
    with pytest.raises(TooManyImagesError, match="max_videos_per_prompt"):
        await qwen.prepare(prompt(qwen, ["video", "video"]), [VIDEO_REF, VIDEO_REF])
    async for llava in make("llava"):
        with pytest.raises(InvalidRequestError, match="takes no video") as caught:
            await llava.prepare(prompt(llava, ["text"]), [VIDEO_REF])
        assert caught.value.param == "messages[0].content[0]"


def test_video_tokens_written_in_text_are_refused(qwen: Renderer) -> None:
    text = prompt(qwen, []) + "<|video_pad|>"
    with pytest.raises(InvalidRequestError, match="video placeholder"):
        asyncio.run(qwen.prepare(text, []))
