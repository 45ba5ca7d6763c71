"""P0's process-wide state: settings, the model processor, the shadow, the engine client.

Build it with :meth:`FrontendState.create` (inside the server's event loop) and close it with
:meth:`FrontendState.close`. Settings come from ``mmis.config.from_env`` with the
section ``frontend`` (``MMIS_FRONTEND_<FIELD>``), CLI flags winning: one
:class:`~mmis.frontend.config.FrontendConfig`.

Invariants:
- One single-worker executor runs every render (the only place the shadow is mutated); the
  engine client's output handler only *enqueues* invalidations (misses, evictions, a changed
  cache epoch) into :class:`PendingInvalidations`, before the outputs that carry them.
- The processor and the model config are loaded at ``revision`` (:func:`load_processor`);
  ``processor_kwargs`` go to every processor call and into every content mm_hash, whose
  model id also names the revision (:func:`hash_model_id`): an image processed one way is
  never served for a request that would have processed it another way.
- ``ready`` becomes true only after a synthetic image request went P0 -> cache -> P1 ->
  output since this process started; :attr:`FrontendState.healthy` is the engine link being
  up (``frontend/client/engine_liveness.py``: false the moment P1's process is gone, and after
  ``liveness_timeout_s`` of silence; true again once the restarted or resumed P1 answered).
  ``/ready`` is ``ready and healthy``, so it is false while P1 is down or restarting;
  ``/health`` answers for this process alone (the pod's liveness probe must not restart
  P0 while P1 restarts: ``tests/kube/test_realnode_mmis.py``).
- While P1 is down, requests wait for it (at most ``engine_wait_s``) or, with ``fail_fast``,
  get a 503 with ``Retry-After`` at once (the rules are in ``frontend/client/recovery.py``).
- :meth:`close` stops the stats poller, the engine client (failing whatever is still in
  flight), the media loader, the executor and the SHM writer (unlinking its segment), in
  that order, then flushes the traces of a tracing setup it built itself.
- With ``--encoder-urls`` / ``--encoder-service`` one :class:`EncoderPool` (started before
  the engine client, closed after it) serves the renderer; without them there is none and
  nothing of E/PD runs.
- Telemetry: one :class:`FrontendTelemetry` (private registry) per state; P0's code counts
  straight into its ``metrics``; P1's figures arrive through the :class:`StatsPoller`.
  Tracing is built from ``otlp_traces_endpoint`` / ``OTEL_*`` (off and free when unset)
  unless the caller hands one in (tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PIL import Image

from mmis.config import GiB
from mmis.frontend.client.encoder_pool import EncoderPool
from mmis.frontend.client.engine_client import EngineClient
from mmis.frontend.client.levels import FrontendLevels
from mmis.frontend.client.lora import LoRARegistry
from mmis.frontend.client.media import MediaLoader
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.frontend.client.processor import ModelProcessor
from mmis.frontend.client.recovery import RecoveryPolicy
from mmis.frontend.client.renderer import Renderer, SourceItem, SourcePrompt
from mmis.frontend.client.stats_poller import StatsPoller
from mmis.frontend.config import FrontendConfig
from mmis.multimodal.cache import SenderCache
from mmis.protocol.encoder import EncoderKey
from mmis.protocol.messages import EngineCoreRequest, SamplingParams
from mmis.shm import ShmWriter
from mmis.telemetry.bundle import FrontendTelemetry
from mmis.telemetry.lora_info import LoRAInfoCollector
from mmis.telemetry.tracing import Tracing, setup_tracing
from mmis.telemetry.tracing_config import TracingConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096


def frontend_tracing(settings: FrontendConfig) -> Tracing:
    """P0's tracing from ``otlp_traces_endpoint`` over ``OTEL_*``; a no-op when unset."""
    import os

    config = TracingConfig.from_env(
        otlp_traces_endpoint=settings.otlp_traces_endpoint,
        service_name=os.environ.get("OTEL_SERVICE_NAME") or "mmis-frontend",
    )
    return setup_tracing(config)


def _max_model_len(model: str, revision: str | None = None) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, revision=revision)
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN))


def text_hidden_size(model: str, revision: str | None = None) -> int | None:
    """The language model's hidden size (an ``image_embeds`` part's width), if the config
    says it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, revision=revision)
    text = getattr(config, "text_config", None) or config
    size = getattr(text, "hidden_size", None)
    return int(size) if isinstance(size, int) else None


def load_processor(settings: FrontendConfig) -> tuple[ModelProcessor, int]:
    """The processor (with the configured call kwargs) and the context window of
    ``settings.model`` at ``settings.revision``."""
    processor = ModelProcessor.from_pretrained(
        settings.model, settings.processor_kwargs, revision=settings.revision
    )
    max_len = settings.max_model_len
    if max_len is None:
        max_len = _max_model_len(settings.model, settings.revision)
    return processor, max_len


def hash_model_id(settings: FrontendConfig) -> str:
    """The model id hashed into every content mm_hash: the model, and its revision if set."""
    return settings.model if settings.revision is None else f"{settings.model}@{settings.revision}"


ENCODER_TOKEN_ENV = "MMIS_ENCODER_TOKEN"


def encoder_pool(settings: FrontendConfig, metrics: Any) -> EncoderPool | None:
    """The encoders of ``--encoder-urls`` / ``--encoder-service`` (None: neither set, E/PD
    off). Their key names ``--model`` and ``--revision`` as ``mmis encoder`` must; the
    token comes from ``MMIS_ENCODER_TOKEN``."""
    import os

    if not settings.encoder_urls and not settings.encoder_service:
        return None
    return EncoderPool(
        EncoderKey(settings.model, settings.revision or ""),
        urls=settings.encoder_urls,
        service=settings.encoder_service,
        timeout_s=settings.encoder_timeout_s,
        token=os.environ.get(ENCODER_TOKEN_ENV) or None,
        metrics=metrics,
    )


def _shm_writer(settings: FrontendConfig) -> ShmWriter | None:
    """The SHM store, or None when it cannot be made: a /dev/shm smaller than ``--shm-gb``
    (a pod's memory ``emptyDir`` below the store, ``ENOSPC`` once the writer's bounded wait
    for a dead writer's memory ran out) is logged as the error it is and the front end
    sends tensors inline instead. Starting anyway keeps the pod out of a crash loop; the
    gauge ``mmis_frontend_shm_capacity_bytes`` is then 0."""
    size = int(settings.shm_gb * GiB)
    try:
        return ShmWriter(size, directory=settings.shm_dir)
    except OSError as exc:
        log.error(
            "shared-memory store not created (%s): %s GiB does not fit in %s; media tensors "
            "travel inline. Give that volume at least --shm-gb plus headroom, or lower --shm-gb",
            exc,
            f"{settings.shm_gb:g}",
            settings.shm_dir,
        )
        return None


class FrontendState:
    def __init__(
        self,
        settings: FrontendConfig,
        processor: ModelProcessor,
        *,
        max_model_len: int,
        tracing: Tracing | None = None,
        embeds_hidden_size: int | None = None,
    ) -> None:
        self.settings = settings
        self.processor = processor
        self.max_model_len = max_model_len
        self.model_name = settings.model_name
        self.served_names = settings.served_names  # the base model's names (not adapters)
        self.telemetry = FrontendTelemetry.create(self.model_name, settings.drift_window_s)
        self.metrics = self.telemetry.metrics
        self.epoch_changes = 0
        self.metrics.attach(FrontendLevels(self))
        self._owns_tracing = tracing is None
        self.tracing = tracing if tracing is not None else frontend_tracing(settings)
        self.shadow = SenderCache(int(settings.mm_cache_gb * GiB))
        self.pending = PendingInvalidations(self.shadow)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmis-mm-render")
        self.shm_writer = _shm_writer(settings) if settings.mm_cache_type == "shm" else None
        self.loader = MediaLoader(settings)
        self.encoders = encoder_pool(settings, self.metrics)
        self.client = EngineClient(
            settings.engine_input_address,
            settings.engine_output_address,
            client_index=settings.client_index,
            on_missing=self._on_missing,
            on_evicted=self._on_evicted,
            on_epoch_change=self._on_epoch_change,
            on_stored=self.pending.learn,
            on_reset=self.pending.request_clear,
            ping_interval_s=settings.ping_interval_s,
            liveness_timeout_s=settings.liveness_timeout_s,
        )
        self.renderer = Renderer(
            processor,
            self.loader,
            self.shadow,
            self.pending,
            self.executor,
            model_id=hash_model_id(settings),
            max_model_len=max_model_len,
            max_images=settings.max_images_per_prompt,
            hash_algorithm=settings.hash_algorithm,
            shm_writer=self.shm_writer,
            metrics=self.metrics,
            encoders=self.encoders,
            enable_mm_embeds=settings.enable_mm_embeds,
            max_embeds_bytes=int(settings.max_request_body_mb * (1 << 20)),
            embeds_hidden_size=embeds_hidden_size,
        )
        self.lora = LoRARegistry(  # the engine's adapters (client/lora.py)
            self.client,
            settings.lora_modules,
            index=settings.client_index,
            stride=settings.api_servers,
        )
        self.metrics.attach(  # mmis:lora_requests_info, the picker's LoRA affinity
            LoRAInfoCollector(self.model_name, self._lora_names)
        )
        self.policy = RecoveryPolicy(
            self.renderer,
            self.client,
            self.metrics,
            self.tracing,
            fail_fast=settings.fail_fast,
            engine_wait_s=settings.engine_wait_s,
        )
        self.stats = StatsPoller(
            self.client, self.telemetry.engine_stats, settings.stats_interval_s
        )
        self.ready = False
        self.ready_event = threading.Event()  # for supervisors in other threads (tests)
        self.started_at = time.time()
        self._probe: asyncio.Task[None] | None = None

    @classmethod
    async def create(
        cls,
        settings: FrontendConfig,
        tracing: Tracing | None = None,
        engine_failed: Callable[[], str | None] | None = None,
    ) -> FrontendState:
        """Load the processor, then wait for P1's handshake (``engine_timeout_s``; stop at
        once when ``engine_failed`` says why it will never come)."""
        loop = asyncio.get_running_loop()
        processor, max_len = await loop.run_in_executor(None, load_processor, settings)
        hidden = None
        if settings.enable_mm_embeds:
            hidden = await loop.run_in_executor(
                None, text_hidden_size, settings.model, settings.revision
            )
        state = cls(
            settings, processor, max_model_len=max_len, tracing=tracing, embeds_hidden_size=hidden
        )
        try:
            if state.encoders is not None:
                await state.encoders.start()
            await state.client.start(timeout=settings.engine_timeout_s, give_up=engine_failed)
            await state.lora.start()  # --lora-modules: a bad adapter is a StartupError
        except BaseException:
            await state.close()
            raise
        state.pending.observe_epoch(state.client.cache_epoch)
        state.renderer.embeds_dtype = state.client.engine_info.get("dtype")
        state.stats.start()
        state._probe = loop.create_task(state._readiness_probe(), name="mmis-ready-probe")
        return state

    def _lora_names(self) -> list[str] | None:
        """The adapters the engine holds as this P0 knows them; None while LoRA is off."""
        return [a.name for a in self.lora.adapters()] if self.lora.enabled else None

    # ------------------------------------------------------------------ engine callbacks
    def _on_missing(self, mm_hashes: list[str]) -> None:
        self.metrics.drift_misses(len(set(mm_hashes)))
        self.metrics.invalidations(self.pending.enqueue(mm_hashes))

    def _on_evicted(self, mm_hashes: list[str]) -> None:
        self.metrics.invalidations(self.pending.enqueue(mm_hashes))

    def _on_epoch_change(self, epoch: str) -> None:
        if self.pending.observe_epoch(epoch):
            self.epoch_changes += 1
            self.lora.engine_restarted()  # the new engine holds no adapter yet

    # ------------------------------------------------------------------ readiness
    async def _readiness_probe(self) -> None:
        """Send one synthetic image request through the whole path; retry until it works."""
        while not self.ready:
            try:
                await self.probe_once()
                self.ready = True
                self.ready_event.set()
                log.info("ready: a synthetic image request went through P0 -> P1")
            except Exception as exc:
                log.warning("readiness probe failed (%s); retrying", exc)
                await asyncio.sleep(1.0)  # back-off between probes, not a synchronisation

    async def probe_once(self) -> None:
        image = Image.new("RGB", (32, 32))
        image.putdata([((x * 8) % 256, (y * 8) % 256, 128) for y in range(32) for x in range(32)])
        text = self.processor.chat_prompt(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "ready"}]}]
        )
        mm_hash = await asyncio.get_running_loop().run_in_executor(
            None, self.renderer.hash_image, image, None
        )
        source = SourcePrompt(
            self.processor.prompt_token_ids(text), [SourceItem(mm_hash, None, image, "ready")]
        )

        def build(rid: str, rendered: Any, choice: int) -> EngineCoreRequest:
            return EngineCoreRequest(
                rid,
                rendered.token_ids,
                rendered.features[choice],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
                arrival_time=time.time(),
            )

        await self.policy.complete(
            source,
            endpoint="ready",
            request_id=f"ready-{time.time_ns()}",
            n=1,
            reserve=1,
            build=build,
        )

    @property
    def healthy(self) -> bool:
        """Whether the engine link is up (P1 connected and answering); false while P1 is
        down, hung or restarting."""
        return self.client.alive

    async def close(self) -> None:
        await self.stats.close()
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._probe
        await self.lora.close()
        await self.client.close()
        if self.encoders is not None:
            await self.encoders.close()
        await self.loader.aclose()
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.shm_writer is not None:
            self.shm_writer.close()
        if self._owns_tracing:
            self.tracing.shutdown()  # flushes the batch exporter
