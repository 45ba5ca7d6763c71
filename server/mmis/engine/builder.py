"""The engine's builder: loads the model, sizes the KV pool, the batch limits and the encoder
cache, and wires scheduler, runner, receiver cache and the process shell (``mmis engine``
parses its flags and calls :func:`build`: ``entrypoints/engine.py``; benchmarks and tests
build their cores with :func:`make_core`).

Invariants:
- The KV pool is preallocated before the engine reports ready, sized by ``--num-kv-blocks``,
  else ``--kv-cache-gb``, else ``--gpu-memory-utilization`` (CUDA, 0.9 by default there:
  after a profiling step on every rank), else the default
  (``engine/execution/kv_sizing.py``); the scheduler's block count is the pool's, and the
  start-up log line names the count and the setting that chose it; with an explicit
  ``--max-model-len`` it holds one sequence of that length (else :class:`EngineStartError`).
  Batch limits left unset are resolved right after (``engine/batch_limits.py``) and logged
  (``batch limits: ...``).
- The model loads in ``--dtype`` (``auto`` resolved per device,
  ``engine/execution/dtype.py``), straight onto the device; the KV cache has the model's dtype.
- ``--revision`` reaches every ``from_pretrained`` of P1 (config and model) through
  :func:`load_model` and the tokenizer. P1 reads the tokenizer only for its grammar engine
  (structured outputs: the vocabulary's token bytes, once, at start-up; without a loadable
  tokenizer structured requests are refused with a 400); stop strings stay P0's. P1 runs the
  model's image processor once, at start-up, on synthetic images, only to size its encoder
  cache for the largest photo (``engine/execution/encoder_sizing.py``;
  ``--encoder-cache-tokens`` skips that).
- On CUDA, after the KV pool and the self-check, decode steps are captured as CUDA graphs and
  verified against eager unless ``--enforce-eager`` or tensor parallelism
  (``engine/execution/decode_graphs.py``); a ``CUDA graphs:`` log line says what was captured
  or why not.
- A setting or model that cannot work raises :class:`EngineStartError` with one line naming
  the cause (the launcher prints it as ``mmis engine: ...`` and exits 1); nothing here exits.
- Event sockets (``--kv-events-*``, ``--mm-events-*``) are ZMQ PLAIN servers with
  ``--events-token``; without it an endpoint that is not loopback is refused before the
  model loads (:func:`check_event_endpoints`; docs/SECURITY.md).
- The model path comes resolved (``cfg.model`` may be a built-in tiny model's name, which
  only the launcher maps: P1 never imports ``mmis.tiny_models``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmis.config import GiB, StartupError
from mmis.engine import batch_limits
from mmis.engine.config import EngineConfig

if TYPE_CHECKING:
    from mmis.engine.core import EngineCore
    from mmis.engine.core_process import EngineCoreProc
    from mmis.engine.event_publisher import EventPublisher
    from mmis.engine.execution.model import ModelAdapter
    from mmis.engine.execution.runner import ModelRunner
    from mmis.engine.execution.structured import GrammarEngine
    from mmis.engine.kv_events import KVEventStream
    from mmis.engine.mm_events import MMEventStream
    from mmis.telemetry.request_spans import RequestSpans
    from mmis.telemetry.tracing import Tracing

log = logging.getLogger("mmis.engine")


class EngineStartError(StartupError):
    """The engine cannot start with these settings or this model; the message says why."""


def set_threads(cfg: EngineConfig) -> int:
    """Size torch's intra-op pool for this rank (``--threads``, else ``mmis/cpus.py``'s
    default); returns the count, also logged."""
    import torch

    from mmis.cpus import rank_threads

    threads = rank_threads(cfg.threads, cfg.tensor_parallel_size)
    torch.set_num_threads(threads)
    log.info("compute threads: %d (%s)", threads, "--threads" if cfg.threads else "default")
    return threads


def load_model(cfg: EngineConfig, path: str) -> ModelAdapter:
    """The model adapter of ``cfg.model`` (resolved to ``path`` by the launcher) at
    ``cfg.revision``."""
    from mmis.engine.execution.dtype import DtypeError, resolve_placement
    from mmis.engine.execution.model import UnsupportedModelError, load_adapter

    try:
        device, dtype = resolve_placement(
            cfg.device, cfg.dtype, path, revision=cfg.revision, what="model", logger=log
        )
    except DtypeError as exc:
        raise EngineStartError(str(exc)) from None
    try:
        return load_adapter(  # LoRA wraps plain projections: no fused q/k/v, gate/up groups
            path, device=device, dtype=dtype, revision=cfg.revision, fuse=not cfg.enable_lora
        )
    except UnsupportedModelError as exc:  # refused before serving anything, saying why
        raise EngineStartError(
            f"cannot serve {cfg.model}: {exc}: serve a model of a supported family (docs/models.md)"
        ) from None


def make_core(
    cfg: EngineConfig,
    runner: ModelRunner,
    spans: RequestSpans | None = None,
    *,
    largest_item: int | None = None,
    tokenizer_dir: str | None = None,
    limits: batch_limits.BatchLimits | None = None,
) -> EngineCore:
    """A scheduler sized from ``cfg``, the runner's KV pool and the largest image item
    (:mod:`mmis.engine.execution.encoder_sizing`), and the core around both (what ``mmis engine``
    runs; benchmarks build theirs here too). The structured-output grammar engine is built
    from the tokenizer in ``tokenizer_dir`` (the runner's model directory); without one the
    core refuses structured requests. ``limits``: the batch limits ``mmis engine`` resolved
    (default: ``cfg``'s where set, else the fixed defaults of
    ``engine/batch_limits.py``)."""
    from mmis.engine.core import EngineCore
    from mmis.engine.execution.encoder_sizing import encoder_cache_tokens
    from mmis.engine.scheduling.sched_config import SchedulerConfig
    from mmis.engine.scheduling.scheduler import Scheduler

    adapter = runner.adapter
    if limits is None:
        limits = batch_limits.resolve(
            cfg.max_num_seqs, cfg.max_num_batched_tokens, on_cpu=adapter.device.type == "cpu"
        )
    max_len = cfg.max_model_len or getattr(adapter.text_config, "max_position_embeddings", None)
    encoder_tokens = encoder_cache_tokens(cfg.encoder_cache_tokens, largest_item)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            num_blocks=runner.pool.num_blocks,
            block_size=cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            encoder_cache_size=encoder_tokens,
            encoder_compute_budget=encoder_tokens,
            max_model_len=max_len,
            whole_mm_spans=adapter.bidirectional_images,
            max_loras=cfg.max_loras,
        )
    )
    if cfg.enable_lora and runner.lora is None:  # engine/lora/: adapters load at run time
        from mmis.engine.lora.manager import LoRAManager

        runner.lora = LoRAManager(  # under tensor parallelism: this rank's shares, its writes
            adapter.model,  # recorded for the workers (engine/execution/tensor_parallel.py)
            max_loras=cfg.max_loras,
            max_rank=cfg.max_lora_rank,
            max_cpu_loras=cfg.max_cpu_loras,
            shards=adapter.tp_shards,
            record_writes=runner.tensor_parallel is not None,
        )
    return EngineCore(
        scheduler,
        runner,
        eos_token_ids=adapter.eos_token_ids,
        max_model_len=max_len,
        spans=spans,
        grammar=None if tokenizer_dir is None else load_grammar(cfg, adapter, tokenizer_dir),
        kv_events=kv_event_stream(cfg),
        async_scheduling=cfg.async_scheduling == "on"
        or (cfg.async_scheduling == "auto" and adapter.device.type == "cuda"),
    )


EVENT_ENDPOINTS = (
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "mm_events_endpoint",
    "mm_events_replay_endpoint",
)


def check_event_endpoints(cfg: EngineConfig) -> None:
    """Without ``--events-token`` every event endpoint must be loopback (docs/SECURITY.md):
    anything else is refused, naming the flag. ``entrypoints/engine.py`` calls it before torch
    is imported (a refusal in a fraction of a second); each publisher checks again as it
    binds (:func:`_event_publisher`)."""
    if cfg.events_token:
        return
    from mmis.config import flag_of
    from mmis.engine.event_auth import is_loopback

    for name in EVENT_ENDPOINTS:
        endpoint = getattr(cfg, name)
        if endpoint and not is_loopback(endpoint):
            raise EngineStartError(
                f"{flag_of(EngineConfig, name)} {endpoint} is reachable from other hosts and "
                "no events token is set: set MMIS_ENGINE_EVENTS_TOKEN (docs/SECURITY.md) or "
                "bind a loopback address"
            )


def _event_publisher(cfg: EngineConfig, pub: str, replay: str) -> EventPublisher:
    """The publisher of the endpoints in settings ``pub`` and ``replay`` (the latter may be
    unset), authenticated with ``--events-token`` when set; EngineStartError if it cannot
    bind."""
    import zmq

    from mmis.config import flag_of
    from mmis.engine.event_auth import EventSocketError
    from mmis.engine.event_publisher import EventPublisher

    check_event_endpoints(cfg)
    endpoint, replay_endpoint = getattr(cfg, pub), getattr(cfg, replay)
    try:
        return EventPublisher(
            zmq.Context.instance(), endpoint, replay_endpoint, token=cfg.events_token
        )
    except EventSocketError as exc:
        raise EngineStartError(str(exc)) from None
    except zmq.ZMQError as exc:
        flags = f"{flag_of(EngineConfig, pub)} {endpoint}"
        if replay_endpoint:
            flags += f" / {flag_of(EngineConfig, replay)} {replay_endpoint}"
        raise EngineStartError(f"cannot bind {flags}: {exc}") from None


def _auth(cfg: EngineConfig) -> str:
    return "PLAIN, events token" if cfg.events_token else "loopback, no token"


def kv_event_stream(cfg: EngineConfig) -> KVEventStream | None:
    """The prefix-cache event stream of ``--kv-events-endpoint`` (docs/ROUTING.md), or None.
    It lives as long as the process (its sockets do not linger). Its blocks carry no token
    ids unless ``--kv-events-token-ids``."""
    if not cfg.kv_events_endpoint:
        return None
    from mmis.engine.kv_events import KVEventLog, KVEventStream

    publisher = _event_publisher(cfg, "kv_events_endpoint", "kv_events_replay_endpoint")
    log.info(
        "KV events on %s (replay: %s; %s%s)",
        publisher.endpoint,
        publisher.replay_endpoint,
        _auth(cfg),
        "; token ids ON" if cfg.kv_events_token_ids else "",
    )
    events = KVEventLog(cfg.block_size, token_ids=cfg.kv_events_token_ids)
    return KVEventStream(events, publisher)


def load_grammar(cfg: EngineConfig, adapter: ModelAdapter, path: str) -> GrammarEngine | None:
    """The structured-output grammar engine for the tokenizer in ``path`` (``None``, logged,
    when it has no tokenizer that loads)."""
    import time

    from mmis.engine.execution.structured import GrammarEngine

    started = time.perf_counter()
    try:
        grammar = GrammarEngine.from_model_dir(
            path,
            vocab_size=int(adapter.vocab_size),
            eos_token_ids=adapter.eos_token_ids,
            revision=cfg.revision,
            cache_size=cfg.grammar_cache_size,
        )
    except Exception as exc:  # no usable tokenizer: serve everything else
        log.warning("structured outputs are off: the tokenizer did not load (%s)", exc)
        return None
    log.info("grammar engine ready in %.2f s", time.perf_counter() - started)
    return grammar


def build(cfg: EngineConfig, path: str, worker_setup: Callable[[str], None]) -> EngineCoreProc:
    """Load the model at ``path`` (``cfg.model`` resolved by the launcher), size the KV pool and
    the batch limits, and wire scheduler, runner, receiver cache and process shell;
    ``worker_setup``: the logging set-up tensor-parallel worker ranks run first (a
    module-level function: ``spawn`` pickles it)."""
    from mmis.engine.core_process import EngineCoreProc
    from mmis.engine.encoder_inputs import EmbedsSpec
    from mmis.engine.execution.attn_backends import AttentionBackendError
    from mmis.engine.execution.encoder_sizing import largest_item, load_image_processor
    from mmis.engine.execution.kv_sizing import KVSizingError, min_blocks, plan_kv_pool
    from mmis.engine.execution.paged_attention import PagedAttentionError
    from mmis.engine.execution.runner import ModelRunner
    from mmis.multimodal.cache import ReceiverCache
    from mmis.shm.reader_set import ShmReaderSet
    from mmis.telemetry.request_spans import RequestSpans

    set_threads(cfg)
    tp = None
    if cfg.tensor_parallel_size > 1:
        from mmis.engine.execution.tensor_parallel import start_workers

        # they load the model meanwhile
        tp, port = start_workers(cfg, path, worker_setup)
        tp.watch()
    adapter = load_model(cfg, path)
    if tp is not None:
        from mmis.engine.execution.tensor_parallel import (
            TensorParallelError,
            init_group,
            shard_adapter,
        )

        try:
            shard_adapter(adapter, 0, tp.size)
        except TensorParallelError as exc:
            raise EngineStartError(f"cannot split {cfg.model}: {exc}") from None
        init_group(adapter.device, 0, tp.size, port)
        log.info("tensor parallel: %d ranks (%s)", tp.size, adapter.device.type)
    from mmis.engine.execution.cpu_linear import pack_adapter

    pack_adapter(adapter, cfg.cpu_linear)  # after the split: it packs each rank's own slice
    max_len = cfg.max_model_len or getattr(adapter.text_config, "max_position_embeddings", None)
    probed = None  # the largest image item: the encoder cache's size, KV sizing's encoder batch
    if cfg.encoder_cache_tokens is None or adapter.device.type == "cuda":
        image_processor = load_image_processor(path, cfg.revision)
        if image_processor is not None:
            probed = largest_item(adapter, image_processor)
    largest = None if probed is None else probed.tokens
    try:
        plan = plan_kv_pool(cfg, adapter, max_len, tp, probed)
    except KVSizingError as exc:
        raise EngineStartError(str(exc)) from None
    try:
        runner = ModelRunner.create(
            adapter,
            block_size=cfg.block_size,
            num_blocks=plan.num_blocks,
            kv_budget_bytes=plan.budget_bytes,
            attention_backend=cfg.attention_backend,
        )
    except AttentionBackendError as exc:
        raise EngineStartError(f"{exc}; choose another --attention-backend") from None
    except PagedAttentionError as exc:
        raise EngineStartError(f"{exc}; raise --kv-cache-gb") from None
    if runner.pool.num_blocks < 2:
        raise EngineStartError(
            f"--kv-cache-gb {cfg.kv_cache_gb} holds {runner.pool.num_blocks} KV "
            f"block(s) of {runner.pool.spec.bytes_per_block} bytes; at least 2 are needed"
        )
    if cfg.max_model_len is not None and runner.pool.num_blocks < min_blocks(
        max_len, cfg.block_size
    ):  # an explicit context the pool cannot hold even once: every long request would fail
        raise EngineStartError(
            f"the KV cache ({plan.source}) holds {runner.pool.num_blocks} blocks of "
            f"{cfg.block_size} tokens, but one request of --max-model-len {max_len} needs "
            f"{min_blocks(max_len, cfg.block_size)}: raise --kv-cache-gb (or "
            "--gpu-memory-utilization on a GPU), or lower --max-model-len"
        )
    if tp is not None:
        tp.send_pool_size(runner.pool.num_blocks)
        runner.tensor_parallel = tp
    limits = batch_limits.resolve(
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        profiled_tokens=plan.step_tokens,
        pool_blocks=None if plan.step_tokens is None else runner.pool.num_blocks,
        block_size=cfg.block_size,
        on_cpu=adapter.device.type == "cpu",
    )
    log.info("batch limits: %s", limits.describe())
    if cfg.self_check:
        from mmis.engine.self_check import SelfCheckError, run_self_check

        try:
            run_self_check(runner)
        except SelfCheckError as exc:
            raise EngineStartError(f"self-check failed: {exc} (--no-self-check skips it)") from None
    from mmis.engine.execution.decode_graphs import setup as setup_decode_graphs

    runner.decode_graphs = setup_decode_graphs(  # logs "CUDA graphs: ..." either way
        adapter,
        runner.pool,
        runner.backend,
        enforce_eager=cfg.enforce_eager,
        max_num_seqs=limits.max_num_seqs,
        max_model_len=max_len,
        tensor_parallel=tp is not None,
    )
    tracing = engine_tracing(cfg)
    spans = RequestSpans(tracing, background=True) if tracing.enabled else None
    core = make_core(
        cfg,
        runner,
        spans,
        largest_item=largest,
        tokenizer_dir=path,
        limits=limits,
    )
    readers = ShmReaderSet(cfg.shm_dir)
    readers.start()  # drops the mappings of removed segments (their memory is then freed)
    receiver = ReceiverCache(int(cfg.mm_cache_gb * GiB), shm_reader=readers.receive)
    log.info(
        "engine ready: %d KV blocks of %d tokens (%s, %s), encoder cache %d tokens (largest "
        "image %s), receiver cache %.2f GiB, epoch %s",
        runner.pool.num_blocks,
        cfg.block_size,
        plan.source,
        str(adapter.dtype).removeprefix("torch."),
        core.scheduler.config.encoder_cache_size,
        largest,
        cfg.mm_cache_gb,
        receiver.epoch,
    )
    return EngineCoreProc(
        core,
        receiver,
        cfg.input_address,
        cfg.output_address,
        cache_epoch=receiver.epoch,
        fault_evict_rate=cfg.fault_evict_rate,
        seed=cfg.seed,
        model_info={
            "dtype": str(adapter.dtype).removeprefix("torch."),
            "device": adapter.device.type,
            "block_size": str(cfg.block_size),  # P0's block keys (protocol/block_keys.py)
        },
        mm_events=mm_event_stream(cfg, receiver.epoch),
        # what an encoder output must be to replace an item's pixels (E/PD)
        embeds_spec=EmbedsSpec(str(adapter.dtype).removeprefix("torch."), adapter.hidden_size),
    )


def mm_event_stream(cfg: EngineConfig, epoch: str) -> MMEventStream | None:
    """The receiver cache's event stream of ``--mm-events-endpoint`` (docs/ROUTING.md), or
    None. It lives as long as the process (its sockets do not linger)."""
    if not cfg.mm_events_endpoint:
        return None
    from mmis.engine.mm_events import MMEventLog, MMEventStream

    publisher = _event_publisher(cfg, "mm_events_endpoint", "mm_events_replay_endpoint")
    log.info(
        "multimodal events on %s (replay: %s; %s)",
        publisher.endpoint,
        publisher.replay_endpoint,
        _auth(cfg),
    )
    return MMEventStream(MMEventLog(), publisher, epoch)


def engine_tracing(cfg: EngineConfig) -> Tracing:
    """P1's tracing: ``--otlp-traces-endpoint`` over ``OTEL_*``; off (no-op) when unset."""
    import os

    from mmis.telemetry.errors import TracingConfigError
    from mmis.telemetry.tracing import setup_tracing
    from mmis.telemetry.tracing_config import TracingConfig

    try:
        config = TracingConfig.from_env(
            otlp_traces_endpoint=cfg.otlp_traces_endpoint,
            service_name=os.environ.get("OTEL_SERVICE_NAME") or "mmis-engine",
        )
    except TracingConfigError as exc:
        raise EngineStartError(str(exc)) from None
    return setup_tracing(config)
