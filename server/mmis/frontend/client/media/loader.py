"""Load the images of a prompt: pick the source by URL scheme, enforce the count, decode.

Invariants:
- Accepted URLs: ``data:`` (base64), ``http(s)://`` (fetched under limits, SSRF-guarded),
  ``file://`` (only below ``allowed_local_media_path``). Anything else is a 400.
- The image count is checked *before* any image is fetched or decoded.
- Every image is size-limited in bytes (all sources) and in pixels (from the header).
- Videos (:meth:`MediaLoader.load_video`) come from the same sources under the same byte
  limit; decoding and frame sampling (:mod:`.video`) run in ``executor`` like images.
- :meth:`MediaLoader.load_encoded` stops before decoding: the renderer decodes only the
  bytes its content memo has not seen (``media/content_memo.py``), under the same limits
  (:meth:`MediaLoader.decode`).
- Blocking work (base64 decoding, file reads, image decoding) runs in ``executor``
  (default: asyncio's), never on the event loop.
- Loading several images is all-or-nothing: the first failure cancels the other loads and is
  raised as is (a typed :class:`~mmis.frontend.errors.MediaError`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import TypeVar

from PIL import Image

from mmis.frontend.client.media.data_url import parse_data_url
from mmis.frontend.client.media.decode import decode_image
from mmis.frontend.client.media.fetch import MediaFetcher
from mmis.frontend.client.media.local import LocalMediaReader
from mmis.frontend.client.media.video import DecodedVideo, VideoLimits, decode_video
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import InvalidMediaError, TooManyImagesError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # decoded, RGB
    data: bytes  # the original encoded bytes, as received
    source: str  # "data" | "http" | "https" | "file"
    media_type: str | None = None  # as declared by the data URL or the HTTP response


def check_image_count(count: int, limit: int, *, param: str | None = "messages") -> None:
    if count > limit:
        raise TooManyImagesError(
            f"the prompt has {count} images, more than the limit of {limit} "
            "(max_images_per_prompt)",
            param=param,
        )


class MediaLoader:
    def __init__(
        self,
        config: FrontendConfig,
        *,
        fetcher: MediaFetcher | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.config = config
        self.fetcher = fetcher or MediaFetcher(config)
        self.local = LocalMediaReader(
            config.allowed_local_media_path, max_bytes=config.media_max_bytes
        )
        self.executor = executor

    async def aclose(self) -> None:
        await self.fetcher.aclose()

    async def load_bytes(
        self, url: str, *, param: str | None = None
    ) -> tuple[bytes, str, str | None]:
        """The encoded bytes behind ``url``: ``(data, source, media_type)``."""
        scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
        if scheme == "data":
            parsed = await self._blocking(  # base64 of megabytes: not on the event loop
                functools.partial(
                    parse_data_url, url, max_bytes=self.config.media_max_bytes, param=param
                )
            )
            return parsed.data, "data", parsed.media_type
        if scheme in ("http", "https"):
            fetched = await self.fetcher.fetch(url, param=param)
            return fetched.data, scheme, fetched.content_type
        if scheme == "file":
            data = await self._blocking(functools.partial(self.local.read, url, param=param))
            return data, "file", None
        shown = url if len(url) <= 64 else url[:61] + "..."
        raise InvalidMediaError(
            f"unsupported image URL {shown!r}: use a data: URL (base64), http(s):// or file://",
            param=param,
        )

    async def load_image(self, url: str, *, param: str | None = None) -> LoadedImage:
        data, source, media_type = await self.load_bytes(url, param=param)
        image = await self.decode(data, param=param)
        return LoadedImage(image=image, data=data, source=source, media_type=media_type)

    def decode_sync(self, data: bytes, param: str | None = None) -> Image.Image:
        """``data`` decoded under this loader's limits (blocking: call it off the loop)."""
        return decode_image(
            data,
            max_pixels=self.config.media_max_pixels,
            formats=self.config.image_formats,
            param=param,
        )

    async def decode(self, data: bytes, *, param: str | None = None) -> Image.Image:
        """:meth:`decode_sync` in ``executor``."""
        return await self._blocking(functools.partial(self.decode_sync, data, param))

    @property
    def video_limits(self) -> VideoLimits:
        c = self.config
        return VideoLimits(
            fps=c.video_fps,
            min_frames=c.video_min_frames,
            max_frames=c.video_max_frames,
            max_duration_s=c.video_max_duration_s,
            max_frame_pixels=c.video_max_frame_pixels,
        )

    async def load_video(self, url: str, *, param: str | None = None) -> DecodedVideo:
        """The sampled frames of the video behind ``url`` (same sources and byte limit as an
        image; decoded and sampled off the event loop, :mod:`.video`)."""
        data, _, _ = await self.load_bytes(url, param=param)
        return await self._blocking(
            functools.partial(decode_video, data, self.video_limits, param=param)
        )

    async def load_images(
        self, urls: Sequence[str], *, params: Sequence[str | None] | None = None
    ) -> list[LoadedImage]:
        """Load all images of one prompt concurrently; all or nothing."""
        check_image_count(len(urls), self.config.max_images_per_prompt)
        names = list(params) if params is not None else [None] * len(urls)
        if len(names) != len(urls):
            raise ValueError("params must be as long as urls")
        tasks: list[asyncio.Task[LoadedImage]] = []
        try:
            async with asyncio.TaskGroup() as group:
                for url, name in zip(urls, names, strict=True):
                    tasks.append(group.create_task(self.load_image(url, param=name)))
        except BaseExceptionGroup as group_error:
            raise _first_leaf(group_error) from None
        return [task.result() for task in tasks]

    async def load_encoded(
        self, urls: Sequence[str], *, params: Sequence[str | None]
    ) -> list[bytes]:
        """The encoded bytes of all images of one prompt, fetched concurrently, not decoded
        (``Renderer.prepare`` decodes what its content memo does not know); all or nothing,
        the count checked first."""
        check_image_count(len(urls), self.config.max_images_per_prompt)
        if len(params) != len(urls):
            raise ValueError("params must be as long as urls")
        tasks: list[asyncio.Task[tuple[bytes, str, str | None]]] = []
        try:
            async with asyncio.TaskGroup() as group:
                for url, name in zip(urls, params, strict=True):
                    tasks.append(group.create_task(self.load_bytes(url, param=name)))
        except BaseExceptionGroup as group_error:
            raise _first_leaf(group_error) from None
        return [task.result()[0] for task in tasks]

    async def _blocking(self, call: functools.partial[T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
