"""The renderer: a prompt with images -> the token ids and multimodal features sent to P1.

Two stages:

1. :meth:`Renderer.prepare` (asyncio): loads the images with the media loader (limits, SSRF
   guard), hashes each one by its content (its encoded bytes with the decoder's identity,
   :meth:`Renderer.hash_encoded`; bytes the content memo has seen are not decoded again:
   :mod:`~mmis.frontend.client.media.content_memo`; their pixels are decoded only if a render
   needs them) and tokenizes the prompt with one image token per
   image, on a worker thread (a long prompt never stalls the event loop), after refusing a
   prompt too long for the context from its length alone. A client's ``uuid`` only names an
   item for its tenant (:mod:`~mmis.frontend.client.tenancy`): sent with data it is bound to
   that data's hash, sent alone it resolves through the binding. The result, a
   :class:`SourcePrompt`, is *retained* by the request's handler so a retry can render it
   again with the cache bypassed.
2. :meth:`Renderer.render` (the single multimodal worker thread): drains the pending
   invalidations FIRST, then per item: a shadow hit (and no bypass) sends ``data=None`` (SHM
   mode: the same descriptor issued again) with the placeholder length the shadow remembers;
   otherwise the processor runs on that image and its tensors are sent (inline, or ``put``
   into the SHM store). Then the prompt is expanded and checked against the context window.

Invariants:
- Every shadow mutation happens on the worker, inside one render, after its drain.
- Every ``mm_hash`` P0 sends is the hash of an item's content: a client's uuid never leaves
  P0 (no engine request, event, block key or trace carries it; only the sender's own 422
  names it). A uuid-only item whose tenant has no binding for it (here, nor in a sibling P0
  of the pod: :mod:`~mmis.frontend.client.sibling_bindings`) is the 422 naming the uuid,
  at :meth:`Renderer.prepare`; one bound to content the shadow no longer holds, the same 422
  at the render.
- A request rejected during rendering (hash-only item not in the shadow -> 422 naming the
  uuid, context window exceeded -> 400) leaves nothing behind: the shadow is updated and SHM
  space is taken only after every check passed, as the last steps of the render. A render
  whose engine requests then cannot be built or sent is undone by :meth:`Renderer.forget`
  (``frontend/client/recovery.py``): the items it recorded with data are queued for
  invalidation, so the next request with them sends their data instead of a shadow hit that
  P1 would answer with a drift miss.
- With ``bypass`` every item that has data is sent with it; hash-only items (a uuid, no URL)
  can only ever be sent as ``data=None``.
- Video items (``modality == "video"``, Qwen2-VL family) follow the same path: loaded and
  sampled in stage 1 (:meth:`MediaLoader.load_video`), hashed as their sampled frames with the
  processor kwargs and the sampled rate (so one clip sampled differently is another item),
  processed by :meth:`ModelProcessor.process_video`, cached in the shadow and sent like an
  image, with the video placeholder token. A model without a video token refuses them (400).
- ``copies`` renders the features for that many sibling requests (``n`` choices); each SHM
  descriptor is issued once per copy, so the reader's acknowledgements balance.
- E/PD (``--encoder-urls`` / ``--encoder-service``, :attr:`Renderer.encoders`): an item with
  pixels or a clip that the shadow says P1 lacks, in a render without ``bypass``, is sent as
  the encoder's output, ``{MM_EMBEDS: [placeholder_length, hidden], ...every processor
  tensor but PIXEL_KEYS}`` (``protocol/encoder.py``), when an encoder answered in time
  (``frontend/client/encoder_asks.py`` over ``frontend/client/encoder_pool.py``), else as its
  pixels. The shadow records the bytes
  actually sent. The render worker never waits on the network (:meth:`Renderer.render`).
  ``bypass`` (the drift retry) and text-only prompts never touch an encoder; without
  encoders nothing of this runs.
- An ``image_embeds`` part (``--enable-mm-embeds``; a 400 naming the flag without it, a 400
  naming the problem for a malformed one: :mod:`~mmis.frontend.client.mm_embeds`, which
  casts it to the engine's dtype, :attr:`Renderer.embeds_dtype`) is an image item whose
  content is :class:`PrecomputedEmbeds`, hashed over its .npy bytes (and grid), sent with
  data ``{MM_EMBEDS, image_grid_thw?}`` like any item (shadow hits included; ``bypass``
  sends it again, never pixels: it has none) and checked by P1 like an encoder's output.
- Placeholder lengths by ``mm_hash`` (the hash covers the pixels and the processor kwargs, so
  it fixes the length) are remembered for the last :data:`KNOWN_LENGTHS` items processed here,
  whether the shadow still holds them or not: a router's repeated key request
  (:meth:`Renderer.keys_sync`, ``POST /internal/block_keys``) runs no processor a second time.
  Only the worker thread touches them. A key request binds no uuid; an item it cannot size
  (a uuid-only item without a binding, :data:`UNBOUND`, or bound to content whose length P0
  no longer knows) ends its keys where that item's placeholder starts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from PIL import Image

from mmis.frontend.client.encoder_asks import Asks, Precomputed, ask_encoders, encodable
from mmis.frontend.client.media import DecodedVideo, MediaLoader, check_image_count
from mmis.frontend.client.media.content_memo import ContentMemo, EncodedImage
from mmis.frontend.client.media.decode import decoder_identity
from mmis.frontend.client.mm_embeds import PrecomputedEmbeds, decode_embeds
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.frontend.client.processor import ModelProcessor, ProcessedImage, PromptError
from mmis.frontend.client.sibling_bindings import SiblingBindings
from mmis.frontend.client.tenancy import ANONYMOUS, UuidBindings
from mmis.frontend.errors import (
    ContextLengthExceededError,
    HashOnlyCacheMissError,
    InvalidRequestError,
    TooManyImagesError,
)
from mmis.multimodal.cache import SenderCache, ShadowEntry, ShadowItem, item_nbytes
from mmis.multimodal.hashing import encoded_item_mm_hash, item_mm_hash, validate_uuid
from mmis.protocol import block_keys
from mmis.protocol.encoder import EncodeItem
from mmis.protocol.messages import MultiModalFeature, ShmAddress
from mmis.shm import ShmError, ShmStoreFullError, ShmWriter
from mmis.telemetry.metrics import MMISMetrics

if TYPE_CHECKING:
    from mmis.frontend.client.encoder_pool import EncoderPool

MODALITY = "image"
VIDEO = "video"
UNBOUND = ""  # the mm_hash of a uuid-only item a key request could not resolve (never sent)


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """An image part of a request: its URL (None = hash-only), its uuid, its JSON path."""

    url: str | None
    uuid: str | None
    param: str | None = None
    detail: str | None = None  # image_url.detail: "low" = the processor's minimum budget
    modality: str = MODALITY  # or VIDEO: a video_url part
    embeds: str | None = None  # an image_embeds part: base64 of a .npy (url and uuid None)
    grid_thw: tuple[int, ...] | None = None  # its image_grid_thw (Qwen2-VL)


ItemData = Image.Image | EncodedImage | DecodedVideo | PrecomputedEmbeds | None
"""An item's content: pixels, bytes whose pixels are decoded on first use, a clip, embeddings
given by the client, or none."""


def _pixels(data: Image.Image | EncodedImage) -> Image.Image:
    return data.image if isinstance(data, EncodedImage) else data


@dataclasses.dataclass(frozen=True)
class SourceItem:
    mm_hash: str  # the content's hash (a uuid-only item: its binding's; UNBOUND in key requests)
    uuid: str | None  # the client's name for it: never sent to P1
    image: ItemData  # None: hash-only, the engine must still hold it
    param: str | None
    processor_kwargs: dict[str, Any] | None = None  # None: the processor's own (--processor-kwargs)
    modality: str = MODALITY


@dataclasses.dataclass(frozen=True)
class SourcePrompt:
    """A prepared request, kept so a retry can render it again with the cache bypassed."""

    token_ids: list[int]  # one image token per item
    items: list[SourceItem]
    param: str = "messages"  # the request field errors about the prompt name

    def hash_only_uuids(self, mm_hashes: Sequence[str]) -> list[str]:
        """The uuids of hash-only items among ``mm_hashes`` (those a retry cannot heal)."""
        wanted = set(mm_hashes)
        return [
            item.uuid
            for item in self.items
            if item.image is None and item.uuid is not None and item.mm_hash in wanted
        ]


@dataclasses.dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    features: list[list[MultiModalFeature]]  # one list per copy
    shadow_hits: int
    processed: int
    recorded: tuple[str, ...] = ()  # hashes the render recorded with their data (processed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class _Planned:
    item: SourceItem
    entry: ShadowEntry
    tensors: dict[str, Any] | None  # None: a shadow hit


KNOWN_LENGTHS = 4096  # placeholder lengths remembered by mm_hash (ints: a few hundred KiB)


class Renderer:
    def __init__(
        self,
        processor: ModelProcessor,
        loader: MediaLoader,
        shadow: SenderCache,
        pending: PendingInvalidations,
        executor: Executor,
        *,
        model_id: str,
        max_model_len: int,
        max_images: int,
        hash_algorithm: str = "blake3",
        shm_writer: ShmWriter | None = None,
        metrics: MMISMetrics | None = None,
        encoders: EncoderPool | None = None,
        enable_mm_embeds: bool = False,
        max_embeds_bytes: int = 32 << 20,
        embeds_hidden_size: int | None = None,
    ) -> None:
        self.processor = processor
        self.loader = loader
        self.shadow = shadow
        self.pending = pending
        self.executor = executor
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.max_images = max_images
        self.hash_algorithm = hash_algorithm
        self.shm_writer = shm_writer
        self.metrics = metrics or MMISMetrics(model_id)
        self.bindings = UuidBindings()  # only the event loop touches it (prepare)
        self.memo = ContentMemo()  # likewise
        self.siblings: SiblingBindings | None = None  # one P0 of N: frontend/api/api_server.py
        self.encoders = encoders  # E/PD: asked for the outputs of the items P1 lacks
        self.enable_mm_embeds = enable_mm_embeds
        self.max_embeds_bytes = max_embeds_bytes
        self.embeds_hidden_size = embeds_hidden_size
        self.embeds_dtype: str | None = None  # the engine's dtype (P1's hello): embeds cast to it
        self._lengths: collections.OrderedDict[str, int] = collections.OrderedDict()

    def _remember(self, mm_hash: str, length: int) -> None:
        self._lengths[mm_hash] = length
        self._lengths.move_to_end(mm_hash)
        if len(self._lengths) > KNOWN_LENGTHS:
            self._lengths.popitem(last=False)

    # ------------------------------------------------------------------ stage 1 (asyncio)
    async def prepare(
        self,
        prompt: str | Sequence[int],
        images: Sequence[ImageRef],
        *,
        param: str = "messages",
        tenant: str | None = ANONYMOUS,
        keys_only: bool = False,
    ) -> SourcePrompt:
        """Load, hash and tokenize (stage 1). ``tenant`` (:mod:`~mmis.frontend.client.tenancy`)
        binds the uuids sent with data and resolves those sent alone; a uuid-only item
        without a binding is a 422 naming it. ``keys_only`` (a router's key request) binds
        nothing and leaves such an item :data:`UNBOUND` instead."""
        videos = [ref for ref in images if ref.modality == VIDEO]
        check_image_count(len(images) - len(videos), self.max_images)
        self._check_videos(videos)
        for ref in images:
            if ref.embeds is not None:
                if not self.enable_mm_embeds:
                    raise InvalidRequestError(
                        "image_embeds parts are not accepted: start the server with "
                        "--enable-mm-embeds to send precomputed image embeddings",
                        param=ref.param,
                    )
            elif ref.uuid is not None:
                validate_uuid(ref.uuid)
            elif ref.url is None:
                raise InvalidRequestError("an image part needs a url or a uuid", param=ref.param)
        with_data = [
            ref
            for ref in images
            if ref.url is not None and ref.modality != VIDEO and ref.embeds is None
        ]
        pictures = iter(await self._load_images(with_data))
        clips = iter(
            [await self.loader.load_video(ref.url or "", param=ref.param) for ref in videos]
        )
        loop = asyncio.get_running_loop()
        hashed: list[tuple[ImageRef, str | None, ItemData, Any]] = []
        for ref in images:
            if ref.modality == VIDEO:
                clip = next(clips)
                kwargs = dict(self.processor.processor_kwargs)
                mm_hash = await loop.run_in_executor(None, self.hash_video, clip, kwargs)
                hashed.append((ref, mm_hash, clip, kwargs))
                continue
            if ref.embeds is not None:
                mm_hash, embeds = await loop.run_in_executor(None, self._embeds_item, ref)
                hashed.append((ref, mm_hash, embeds, None))
                continue
            if ref.url is None:  # uuid only: resolved below
                hashed.append((ref, None, None, self.processor.image_kwargs(ref.detail)))
                continue
            hashed.append((ref, *next(pictures)))
        if isinstance(prompt, str):
            self._check_prompt_chars(len(prompt), param)
        token_ids = await loop.run_in_executor(None, self.processor.prompt_token_ids, prompt)
        slots = sum(t == self.processor.image_token_id for t in token_ids)
        if slots != len(images) - len(videos):
            raise InvalidRequestError(
                f"the prompt has {slots} image placeholder token(s) for "
                f"{len(images) - len(videos)} image(s); "
                f"do not write the image token {self.processor.image_token!r} in text",
                param=param,
            )
        if self.processor.video_token_id is not None:
            found = sum(t == self.processor.video_token_id for t in token_ids)
            if found != len(videos):
                raise InvalidRequestError(
                    f"the prompt has {found} video placeholder token(s) for {len(videos)} "
                    f"video(s); do not write the video token {self.processor.video_token!r} "
                    "in text",
                    param=param,
                )
        if self.siblings is not None and tenant is not None:
            await self._ask_siblings(self.siblings, hashed, tenant)
        items = self._bind(hashed, tenant, keys_only, param)
        return SourcePrompt(token_ids=token_ids, items=items, param=param)

    def _embeds_item(self, ref: ImageRef) -> tuple[str, PrecomputedEmbeds]:
        """An ``image_embeds`` part's mm_hash (of its .npy bytes and grid) and content."""
        raw, embeds = decode_embeds(
            ref.embeds or "",
            ref.grid_thw,
            max_bytes=self.max_embeds_bytes,
            merge_size=getattr(
                getattr(self.processor.processor, "image_processor", None), "merge_size", None
            ),
            param=ref.param or "messages",
            hidden_size=self.embeds_hidden_size,
            dtype=self.embeds_dtype,
        )
        mm_hash = item_mm_hash(
            model_id=self.model_id,
            modality="image_embeds",
            item=raw,
            processor_kwargs={"image_grid_thw": list(ref.grid_thw or ())},
            algorithm=self.hash_algorithm,
        )
        return mm_hash, embeds

    async def _ask_siblings(
        self,
        siblings: SiblingBindings,
        hashed: Sequence[tuple[ImageRef, str | None, ItemData, Any]],
        tenant: str,
    ) -> None:
        """Bind here what another P0 of the pod bound (``--api-servers``): each uuid-only item
        this process cannot resolve (:mod:`~mmis.frontend.client.sibling_bindings`)."""
        for ref, mm_hash, _, _ in hashed:
            if mm_hash is not None or ref.uuid is None:
                continue
            if self.bindings.resolve(tenant, ref.modality, ref.uuid) is not None:
                continue
            found = await siblings.resolve(tenant, ref.modality, ref.uuid)
            if found is None:
                continue
            content, entry = found
            self.bindings.bind(tenant, ref.modality, ref.uuid, content)
            if entry is not None and not self.shadow.is_cached(content):
                self.pending.learn([entry])  # the next render's drain applies it

    async def _load_images(
        self, refs: Sequence[ImageRef]
    ) -> list[tuple[str, Image.Image | EncodedImage, dict[str, Any]]]:
        """``(mm_hash, pixels, kwargs)`` of each image with a URL, hashed as its bytes
        (:meth:`hash_encoded`, one pass over them): bytes whose hash the content memo knows
        (``media/content_memo.py``) keep their bytes, decoded only if a render needs them; the
        others are decoded (the limits checked) concurrently, and remembered."""
        datas = await self.loader.load_encoded(
            [ref.url or "" for ref in refs], params=[ref.param for ref in refs]
        )
        loop = asyncio.get_running_loop()
        kwargs_list = [self.processor.image_kwargs(ref.detail) for ref in refs]
        hashes = await asyncio.gather(
            *(
                loop.run_in_executor(None, self.hash_encoded, data, kwargs)
                for data, kwargs in zip(datas, kwargs_list, strict=True)
            )
        )

        async def one(
            ref: ImageRef, data: bytes, mm_hash: str, kwargs: dict[str, Any]
        ) -> tuple[str, Image.Image | EncodedImage, dict[str, Any]]:
            if self.memo.knows(mm_hash):
                return mm_hash, EncodedImage(data, self.loader.decode_sync), kwargs
            image = await self.loader.decode(data, param=ref.param)
            self.memo.remember(mm_hash)
            return mm_hash, image, kwargs

        return list(
            await asyncio.gather(
                *(
                    one(ref, d, h, k)
                    for ref, d, h, k in zip(refs, datas, hashes, kwargs_list, strict=True)
                )
            )
        )

    def _bind(
        self,
        hashed: Sequence[tuple[ImageRef, str | None, ItemData, Any]],
        tenant: str | None,
        keys_only: bool,
        param: str,
    ) -> list[SourceItem]:
        """The request's items, in prompt order: a uuid sent with data is bound to its content
        hash (a rebind counted), a uuid sent alone resolved through ``tenant``'s binding (an
        earlier item of the same request included). Runs on the event loop, without a
        suspension point, so the bindings change atomically per request."""
        items: list[SourceItem] = []
        unbound: list[str] = []
        for ref, mm_hash, data, kwargs in hashed:
            uuid = ref.uuid
            if mm_hash is None and uuid is not None:
                mm_hash = self.bindings.resolve(tenant, ref.modality, uuid)
                if mm_hash is None:
                    unbound.append(uuid)
                    mm_hash = UNBOUND
            elif mm_hash is not None and uuid is not None and tenant is not None and not keys_only:
                rebound = self.bindings.bind(tenant, ref.modality, uuid, mm_hash)
                if rebound:
                    self.metrics.uuid_rebinds()
            if mm_hash is None:  # unreachable: prepare refused a part without url and uuid
                raise InvalidRequestError("an image part needs a url or a uuid", param=ref.param)
            items.append(SourceItem(mm_hash, uuid, data, ref.param, kwargs, ref.modality))
        if unbound and not keys_only:
            raise HashOnlyCacheMissError(unbound, param=param)
        return items

    def _check_videos(self, videos: Sequence[ImageRef]) -> None:
        if not videos:
            return
        if self.processor.video_token_id is None:
            raise InvalidRequestError(
                "this model takes no video input (its processor declares no video token)",
                param=videos[0].param,
            )
        limit = self.loader.config.max_videos_per_prompt
        if len(videos) > limit:
            raise TooManyImagesError(
                f"the prompt has {len(videos)} videos, more than the limit of {limit} "
                "(max_videos_per_prompt)",
                param="messages",
            )

    def hash_video(self, video: DecodedVideo, processor_kwargs: dict[str, Any]) -> str:
        """A video's mm_hash: its sampled frames, the processor kwargs and the sampled rate."""
        return item_mm_hash(
            model_id=self.model_id,
            modality=VIDEO,
            item=video.frames,
            processor_kwargs={**processor_kwargs, "mmis_sampled_fps": float(video.fps)},
            algorithm=self.hash_algorithm,
        )

    def hash_encoded(self, data: bytes, processor_kwargs: dict[str, Any] | None = None) -> str:
        """The mm_hash of an image received as ``data`` (every image a request carries): those
        bytes, the decoder's identity (``media/decode.py`` ``decoder_identity``: Pillow, its
        codecs, the format list) and the processor kwargs (default: the processor's). The same
        pixels in other bytes are another item (``multimodal/hashing.py``)."""
        kwargs = self.processor.processor_kwargs if processor_kwargs is None else processor_kwargs
        return encoded_item_mm_hash(
            model_id=self.model_id,
            modality=MODALITY,
            data=data,
            decoder=decoder_identity(tuple(self.loader.config.image_formats)),
            processor_kwargs=kwargs,
            algorithm=self.hash_algorithm,
        )

    def hash_image(self, image: Image.Image, processor_kwargs: dict[str, Any] | None = None) -> str:
        """The mm_hash of an image made in this process, without bytes (the readiness probe):
        its pixels and the processor kwargs (default: the processor's). Never equal to a
        :meth:`hash_encoded` hash."""
        kwargs = self.processor.processor_kwargs if processor_kwargs is None else processor_kwargs
        return item_mm_hash(
            model_id=self.model_id,
            modality=MODALITY,
            item=image,
            processor_kwargs=kwargs,
            algorithm=self.hash_algorithm,
        )

    # ------------------------------------------------------------------ stage 2 (worker)
    async def render(
        self, source: SourcePrompt, *, bypass: bool, reserve_tokens: int, copies: int = 1
    ) -> RenderedPrompt:
        """Render on the multimodal worker (see the module docstring).

        With encoders (E/PD) and no ``bypass``, three steps, the worker never waiting on the
        network: the worker processes the items the shadow says P1 lacks
        (:meth:`encoder_asks`), the event loop awaits their outputs from the encoders
        (``frontend/client/encoder_asks.py`` ``ask_encoders``, bounded by
        ``--encoder-timeout-s``), and the worker
        renders with both (:meth:`render_sync`'s ``precomputed``): an item with an output
        goes as ``{MM_EMBEDS, non-pixel tensors}``, one without as its pixels. An item the
        shadow gained meanwhile is a hit, its precomputed entry unused."""
        loop = asyncio.get_running_loop()
        precomputed: Precomputed | None = None
        pool = self.encoders
        if pool is not None and not bypass and any(encodable(i.image) for i in source.items):
            asks = await loop.run_in_executor(self.executor, self.encoder_asks, source)
            if asks:
                precomputed = await ask_encoders(pool, asks)
        return await loop.run_in_executor(
            self.executor, self.render_sync, source, bypass, reserve_tokens, copies, precomputed
        )

    def encoder_asks(self, source: SourcePrompt) -> Asks:
        """On the worker: each item P1 lacks (no shadow entry) that an encoder could encode
        (``frontend/client/encoder_asks.py``), processed, as ``mm_hash -> (what to ask, its
        processor tensors)``. Changes nothing but the remembered lengths (the pending
        invalidations are drained, as a render does first)."""
        self.pending.drain()
        asks: Asks = {}
        for item in source.items:
            if not encodable(item.image) or item.mm_hash in asks:
                continue
            if self.shadow.is_cached(item.mm_hash):
                continue
            processed = self._process(item)
            self._remember(item.mm_hash, processed.num_tokens)
            ask = EncodeItem(
                mm_hash=item.mm_hash,
                modality=item.modality,
                placeholder_length=processed.num_tokens,
                data=processed.tensors,
            )
            asks[item.mm_hash] = (ask, processed.tensors)
        return asks

    def _process(self, item: SourceItem) -> ProcessedImage:
        if isinstance(item.image, DecodedVideo):
            return self.processor.process_video(item.image, item.processor_kwargs)
        if isinstance(item.image, PrecomputedEmbeds):
            return ProcessedImage(item.image.tensors, item.image.num_tokens)
        if item.image is None:  # unreachable: hash-only items are never processed
            raise HashOnlyCacheMissError([item.uuid or item.mm_hash])
        return self.processor.process_image(_pixels(item.image), item.processor_kwargs)

    async def keys(
        self, source: SourcePrompt, block_size: int, lora_id: int = 0
    ) -> tuple[int, list[bytes]]:
        """:meth:`keys_sync` on the multimodal worker (it reads the shadow renders write)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, self.keys_sync, source, block_size, lora_id
        )

    def render_sync(
        self,
        source: SourcePrompt,
        bypass: bool,
        reserve_tokens: int,
        copies: int = 1,
        precomputed: Mapping[str, tuple[int, dict[str, Any]]] | None = None,
    ) -> RenderedPrompt:
        """The render itself, on the worker. ``precomputed`` (``mm_hash -> (placeholder
        length, data)``, from :meth:`render`'s E/PD step) replaces processing an item sent
        with data; never used with ``bypass``."""
        self.pending.drain()  # before the first lookup: invalidations reported so far apply
        entries = self.shadow.lookup([item.mm_hash for item in source.items])
        missing = [
            item.uuid or item.mm_hash
            for item, entry in zip(source.items, entries, strict=True)
            if entry is None and item.image is None
        ]
        if missing:
            raise HashOnlyCacheMissError(missing)
        plan: list[_Planned] = []
        for item, entry in zip(source.items, entries, strict=True):
            if entry is not None and (item.image is None or not bypass):
                plan.append(_Planned(item, entry, None))
                continue
            if item.image is None:  # unreachable: hash-only misses were rejected above
                raise HashOnlyCacheMissError([item.uuid or item.mm_hash])
            ready = None if bypass or precomputed is None else precomputed.get(item.mm_hash)
            if ready is not None:
                processed = ProcessedImage(ready[1], ready[0])
            else:
                processed = self._process(item)
            nbytes = item_nbytes(processed.tensors)
            self._remember(item.mm_hash, processed.num_tokens)
            plan.append(
                _Planned(item, ShadowEntry(nbytes, processed.num_tokens), processed.tensors)
            )
        try:
            token_ids, ranges = self.processor.expand(
                source.token_ids,
                [p.entry.placeholder_length for p in plan],
                [self._placeholder_token(p.item) for p in plan],
            )
        except PromptError as exc:
            raise InvalidRequestError(str(exc), param=source.param) from exc
        self._check_context(len(token_ids), reserve_tokens, len(plan), source.param)
        # every check passed: from here on the request is accepted
        features: list[list[MultiModalFeature]] = [[] for _ in range(copies)]
        recorded: list[ShadowItem] = []
        for p, placeholder in zip(plan, ranges, strict=True):
            datas, entry = self._payloads(p, copies)
            recorded.append(ShadowItem(p.item.mm_hash, entry))
            for copy, data in enumerate(datas):
                features[copy].append(
                    MultiModalFeature(
                        modality=p.item.modality,
                        mm_hash=p.item.mm_hash,
                        placeholder=placeholder,
                        data=data,
                    )
                )
        self.shadow.record_request(recorded)
        hits = sum(p.tensors is None for p in plan)
        self.metrics.processor_cache(len(plan), hits)
        self.metrics.shadow_hits(hits)
        recorded_with_data = tuple(p.item.mm_hash for p in plan if p.tensors is not None)
        return RenderedPrompt(token_ids, features, hits, len(plan) - hits, recorded_with_data)

    def keys_sync(
        self, source: SourcePrompt, block_size: int, lora_id: int = 0
    ) -> tuple[int, list[bytes]]:
        """``(prompt tokens, block keys)`` of the prompt a render would send P1 now
        (``protocol/block_keys.py``), changing nothing: the shadow, its counters and the
        metrics stay as they were. An item the shadow knows keeps its recorded placeholder
        length, else its remembered one; any other item with data is processed to learn it
        (and its length remembered). A hash-only item of unknown length (:data:`UNBOUND`, or
        its content forgotten) cannot be placed: the prompt tokens and the keys then stop
        where its placeholder starts. ``lora_id``: the LoRA adapter's id (0: the base model),
        whose blocks P1 keys apart."""
        lengths: list[int] = []
        cut: int | None = None  # the first item that cannot be placed
        for index, item in enumerate(source.items):
            entry = self.shadow.get(item.mm_hash) if item.mm_hash != UNBOUND else None
            known = self._lengths.get(item.mm_hash)
            if entry is not None:
                lengths.append(entry.placeholder_length)
            elif known is not None:
                lengths.append(known)
            elif item.image is None:
                cut = index if cut is None else cut
                lengths.append(1)  # a stand-in: nothing from its placeholder on is keyed
            else:
                n = self._process(item).num_tokens
                self._remember(item.mm_hash, n)
                lengths.append(n)
        try:
            token_ids, ranges = self.processor.expand(
                source.token_ids, lengths, [self._placeholder_token(i) for i in source.items]
            )
        except PromptError as exc:
            raise InvalidRequestError(str(exc), param=source.param) from exc
        features = [
            MultiModalFeature(modality=item.modality, mm_hash=item.mm_hash, placeholder=placeholder)
            for item, placeholder in zip(source.items, ranges, strict=True)
        ]
        if cut is not None:
            token_ids = token_ids[: ranges[cut].offset]
            features = features[:cut]
        return len(token_ids), block_keys.chain(token_ids, features, block_size, lora_id=lora_id)

    def forget(self, rendered: RenderedPrompt) -> int:
        """Undo what a render recorded for the items it processed and sent with data, when its
        engine requests were never sent: they are queued for invalidation (applied by the next
        render, on the worker, before its first lookup), so the next request carrying them
        sends their data. Returns how many hashes were queued."""
        return self.pending.enqueue(rendered.recorded)

    def _placeholder_token(self, item: SourceItem) -> int:
        if item.modality == VIDEO and self.processor.video_token_id is not None:
            return self.processor.video_token_id
        return self.processor.image_token_id

    def _payloads(
        self, p: _Planned, copies: int
    ) -> tuple[list[dict[str, Any] | ShmAddress | None], ShadowEntry]:
        """The ``data`` of each copy of one item, and the shadow entry to record."""
        address = p.entry.metadata.get("shm")
        writer = self.shm_writer
        if p.tensors is None:
            if writer is None or not isinstance(address, ShmAddress):
                return [None] * copies, p.entry
            try:  # SHM mode: a hit re-issues the live descriptor, once per copy
                return [writer.share(address) for _ in range(copies)], p.entry
            except ShmError:
                pass  # reclaimed or expired since: P1 still holds the tensors by hash
            return [None] * copies, dataclasses.replace(p.entry, metadata={})
        if writer is not None:
            try:
                first = writer.put(p.tensors)
                rest = [writer.share(first) for _ in range(copies - 1)]
                return [first, *rest], dataclasses.replace(p.entry, metadata={"shm": first})
            except ShmStoreFullError:
                pass  # the store is full: send inline
        return [p.tensors] * copies, p.entry

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse a prompt that cannot fit from its length alone, before tokenizing it."""
        per_token = self.processor.max_token_chars
        if chars <= self.max_model_len * per_token:
            return
        raise ContextLengthExceededError(
            f"the prompt has {chars} characters, so at least {chars // per_token} tokens "
            f"(this tokenizer's longest token has {per_token} characters), which exceeds the "
            f"model's context window of {self.max_model_len} tokens",
            param=param,
        )

    def _check_context(self, num_tokens: int, reserve: int, num_images: int, param: str) -> None:
        if num_tokens + reserve <= self.max_model_len:
            return
        what = f"the prompt has {num_tokens} tokens"
        if num_images:
            what += f" (with {num_images} image(s))"
        if reserve > 0:
            what += f" and {reserve} more are requested (max_tokens)"
        raise ContextLengthExceededError(
            f"{what}, which exceeds the model's context window of {self.max_model_len} tokens",
            param=param,
        )
