"""Tensor parallelism: the language model's layers split over ``--tensor-parallel-size`` ranks.

Each decoder layer is split the Megatron way, in place on the unmodified Hugging Face modules:
``q_proj``/``k_proj``/``v_proj`` keep their rank's attention heads (rows), ``gate_proj``/
``up_proj`` their rank's slice of the MLP (rows), and ``o_proj``/``down_proj`` the matching
input columns, followed by one ``all_reduce`` each (:class:`RowParallelLinear`; a bias is
added once, after the sum). Embeddings, the final norm, the LM head and the vision tower stay
whole; only rank 0 uses the last two.

Rank 0 is the engine process (scheduler, runner, sampler, sockets). It starts ranks
``1 .. size - 1`` as worker processes (:func:`start_workers`, ``spawn``), which load the same
checkpoint, split it the same way, allocate a KV pool of the same block count for their own
KV heads, and then run only language-model forwards (:func:`worker_main`). Before every
forward, rank 0's runner broadcasts the step (:meth:`TensorParallel.broadcast_step`: the
attention metadata's build arguments, then the input embeddings and positions); every rank
builds the same metadata and runs the same forward over its own pool, so the collectives pair
up. ``torch.distributed`` runs NCCL on CUDA (rank ``r`` on ``cuda:r``), gloo on CPU.

Invariants:
- Every language-model forward of rank 0 goes through :meth:`ModelRunner.execute`, which
  broadcasts first, or is the self-check's plain-transformers reference, which broadcasts
  its prompt first (:meth:`TensorParallel.broadcast_plain`; every rank runs the model's own
  forward).
- Before the pool exists, rank 0 sends either its block count or a profiling step of KV
  sizing (``engine/execution/kv_sizing.py``: :meth:`TensorParallel.begin_profile`, then the step's
  usual broadcast); a worker runs it over a pool of the same size, reads its own device, and
  every rank takes the minimum of the readings (:func:`agree_min`), so the count rank 0 then
  sends fits every device.
- Under ``--enable-lora`` every rank wraps its split projections with its share of each
  adapter (``engine/lora/layer.py``; the tower's, on rank 0 only); rank 0's step broadcast
  carries its slot writes (each with rank 0's host copy of the adapter: workers read no
  adapter files) and each sequence's slot, which the workers apply before the same forward
  (:meth:`WorkerRank.forward`), so all ranks' slots hold the same adapters.
- Heads, KV heads and the MLP width must divide by the size, or the model is refused at
  start-up (:class:`TensorParallelError`) naming the numbers.
- A worker that exits ends the engine (rank 0 exits 1 rather than wait in a collective),
  except when the model does not split (:data:`UNSPLITTABLE`: rank 0 refuses it itself,
  with the message); a worker whose engine is gone exits; rank 0's shutdown stops them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_STOP = "stop"
_STEP = "step"
_PLAIN = "plain"
_PROFILE = "profile"
UNSPLITTABLE = 3  # a worker's exit code when the model does not split: rank 0 says why


class TensorParallelError(ValueError):
    """The model cannot be split over the requested number of ranks."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's share of one split projection: ``dim`` ``"out"`` (column-parallel: output
    rows ``lo:hi``) or ``"in"`` (row-parallel: input columns ``lo:hi``, partial outputs summed)
    of ``full`` (the unsplit size). ``shard_adapter`` records one per split projection in
    ``adapter.tp_shards`` (module name in ``adapter.model`` -> Shard), which ``engine/lora/``
    reads to split its adapters the same way."""

    dim: str
    lo: int
    hi: int
    full: int


class RowParallelLinear(torch.nn.Module):
    """A linear layer holding a slice of the input columns; partial outputs summed
    (``forward`` = :meth:`finish` of :meth:`partial`: a LoRA delta goes in between)."""

    def __init__(self, linear: torch.nn.Linear, lo: int, hi: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.data[:, lo:hi].clone(), False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.data.clone(), False)
        self.in_features, self.out_features = hi - lo, linear.out_features  # this rank's

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (no bias)."""
        return torch.nn.functional.linear(x, self.weight)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """Every rank's shares summed (in place), then the bias."""
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(x))


def _keep_rows(linear: torch.nn.Linear, lo: int, hi: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.data[lo:hi].clone(), False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[lo:hi].clone(), False)
    linear.out_features = hi - lo


def _part(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if total % size:
        raise TensorParallelError(
            f"{what} ({total}) does not divide by --tensor-parallel-size {size}"
        )
    step = total // size
    return rank * step, (rank + 1) * step


def shard_adapter(adapter: Any, rank: int, size: int) -> None:
    """Split ``adapter``'s language model for ``rank`` of ``size`` (see the docstring); fused
    projections (``model/fused.py``) are split apart first and this rank's rows fused again."""
    from mmis.engine.execution.model.fused import fuse_projections, unfuse_projections

    heads, kv_heads, head_dim = adapter.num_heads, adapter.num_kv_heads, adapter.head_dim
    fused = unfuse_projections(adapter.language_model.layers)
    q_lo, q_hi = _part(heads, rank, size, "attention heads")
    kv_lo, kv_hi = _part(kv_heads, rank, size, "KV heads")
    layers = adapter.language_model.layers
    prefix = next(n for n, m in adapter.model.named_modules() if m is layers)
    shards: dict[str, Shard] = {}
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), torch.nn.Linear):
                raise TensorParallelError(f"decoder layer {i} has no linear self_attn.{name}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), torch.nn.Linear):
                raise TensorParallelError(f"decoder layer {i} has no linear mlp.{name}")
        q_rows, kv_rows = (q_lo * head_dim, q_hi * head_dim), (kv_lo * head_dim, kv_hi * head_dim)
        m_lo, m_hi = _part(mlp.gate_proj.out_features, rank, size, "MLP width")
        splits = {
            "self_attn.q_proj": ("out", *q_rows, attn.q_proj.out_features),
            "self_attn.k_proj": ("out", *kv_rows, attn.k_proj.out_features),
            "self_attn.v_proj": ("out", *kv_rows, attn.v_proj.out_features),
            "self_attn.o_proj": ("in", *q_rows, attn.o_proj.in_features),
            "mlp.gate_proj": ("out", m_lo, m_hi, mlp.gate_proj.out_features),
            "mlp.up_proj": ("out", m_lo, m_hi, mlp.up_proj.out_features),
            "mlp.down_proj": ("in", m_lo, m_hi, mlp.down_proj.in_features),
        }
        for name, (dim, lo, hi, full) in splits.items():
            shards[f"{prefix}.{i}.{name}"] = Shard(dim, lo, hi, full)
        _keep_rows(attn.q_proj, *q_rows)
        _keep_rows(attn.k_proj, *kv_rows)
        _keep_rows(attn.v_proj, *kv_rows)
        attn.o_proj = RowParallelLinear(attn.o_proj, *q_rows)
        _keep_rows(mlp.gate_proj, m_lo, m_hi)
        _keep_rows(mlp.up_proj, m_lo, m_hi)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, m_lo, m_hi)
    adapter.num_heads, adapter.num_kv_heads = q_hi - q_lo, kv_hi - kv_lo
    adapter.tp_shards = shards
    if fused:
        fuse_projections(adapter.language_model.layers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_group(device: torch.device, rank: int, size: int, port: int) -> None:
    """Join the process group: NCCL on CUDA (this rank's GPU), gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank_device(device, rank))
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )


@dataclasses.dataclass
class TensorParallel:
    """Rank 0's side: the workers and the per-step broadcast."""

    size: int
    device: torch.device
    workers: list[Any]
    stopping: bool = False

    def broadcast_step(
        self,
        num_tokens: Sequence[int],
        starts: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        spans: Sequence[Sequence[tuple[int, int]]] | None,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        *,
        lora_writes: Sequence[tuple[int, Any]] = (),
        lora_slots: Sequence[int] | None = None,
    ) -> None:
        """Send one step's forward inputs to every worker (called right before rank 0's);
        under LoRA, the slot writes since the last step (``(slot, adapter)``: rank 0's host
        copy, ``engine/lora/adapter.py`` ``LoRAAdapter``, replayed in order; pickled into the
        header, so a write costs the adapter's float32 bytes once per step that writes) and
        each sequence's slot (None: a base-only step)."""
        args = {
            "num_tokens": list(num_tokens),
            "starts": list(starts),
            "block_tables": [list(t) for t in block_tables],
            "spans": None if spans is None else [list(x) for x in spans],
            "lora_writes": [tuple(w) for w in lora_writes],
            "lora_slots": None if lora_slots is None else list(lora_slots),
        }
        header: list[Any] = [(_STEP, args, tuple(embeds.shape), tuple(positions.shape))]
        dist.broadcast_object_list(header, src=0, device=self._comm_device)
        dist.broadcast(embeds.contiguous(), src=0)
        dist.broadcast(positions.contiguous(), src=0)

    def broadcast_plain(self, ids: Sequence[int]) -> None:
        """Have every worker run the model's own forward on ``ids`` (the self-check's)."""
        dist.broadcast_object_list([(_PLAIN, list(ids))], src=0, device=self._comm_device)

    def send_pool_size(self, num_blocks: int) -> None:
        dist.broadcast_object_list([num_blocks], src=0, device=self._comm_device)

    def begin_profile(self, num_blocks: int, fraction: float, *, last: bool) -> None:
        """Tell the workers the next step is a KV sizing profile over ``num_blocks`` blocks
        (``fraction``: ``--gpu-memory-utilization``; ``last``: the step size is taken
        whatever its activations need)."""
        message = [(_PROFILE, num_blocks, fraction, last)]
        dist.broadcast_object_list(message, src=0, device=self._comm_device)

    def agree_min(self, values: Sequence[int]) -> list[int]:
        return agree_min(values, self._comm_device)

    @property
    def _comm_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def watch(self) -> None:
        """End this process if a worker exits (it would wait in a collective forever)."""

        def loop() -> None:
            while not self.stopping:
                for w in self.workers:
                    if not w.is_alive() and not self.stopping and w.exitcode != UNSPLITTABLE:
                        log.error("tensor-parallel rank exited (code %s): stopping", w.exitcode)
                        os._exit(1)
                time.sleep(0.5)

        threading.Thread(target=loop, name="tp-watch", daemon=True).start()

    def shutdown(self) -> None:
        self.stopping = True
        with contextlib.suppress(Exception):  # a worker already gone: nothing to tell it
            dist.broadcast_object_list([(_STOP,)], src=0, device=self._comm_device)
        for w in self.workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()


def agree_min(values: Sequence[int], comm: torch.device | None) -> list[int]:
    """Every rank's ``values``, element-wise minimum over the ranks (a collective: all call
    it together)."""
    tensor = torch.tensor(list(values), dtype=torch.int64, device=comm)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return [int(v) for v in tensor.tolist()]


def _base_device(cfg: Any) -> torch.device:
    from mmis.engine.execution.model.adapter import default_device

    return torch.device(cfg.device) if cfg.device is not None else default_device()


def start_workers(
    cfg: Any, path: str | os.PathLike[str], setup_logging: Callable[[str], None]
) -> tuple[TensorParallel, int]:
    """Start ranks ``1 .. size - 1`` (they load the model at ``path``, resolved by the
    launcher, themselves, and set up logging with the launcher's ``setup_logging``, a
    module-level function so that ``spawn`` can pickle it); returns the handle and the
    rendezvous port rank 0 joins with :func:`init_group`."""
    import multiprocessing

    device = rank_device(_base_device(cfg), 0)
    ctx = multiprocessing.get_context("spawn")
    port, size = free_port(), int(cfg.tensor_parallel_size)
    workers = [
        ctx.Process(
            target=worker_main,
            args=(cfg, str(path), setup_logging, rank, size, port, os.getpid()),
            name=f"mmis-tp-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for w in workers:
        w.start()
    return TensorParallel(size, device, workers), port


@dataclasses.dataclass
class WorkerRank:
    """A worker rank's model and what its forwards need."""

    adapter: Any
    backend: Any
    block_size: int
    dtype: torch.dtype
    device: torch.device
    lora: Any = None  # engine/lora/manager.py's LoRAManager, a mirror (--enable-lora)
    reserved: int = 0  # bytes KV sizing holds aside (the LoRA slots, allocated after it)

    @property
    def comm(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def receive(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, device=self.comm)
        return box[0]

    def forward(self, header: Any, pool: Any) -> None:
        """Rank 0's step ``header``: receive its inputs and run the same forward."""
        from mmis.engine.execution.attn_metadata import AttentionMetadata
        from mmis.engine.execution.paged_attention import PagedStep

        _, args, embeds_shape, positions_shape = header
        embeds = torch.empty(embeds_shape, dtype=self.dtype, device=self.device)
        positions = torch.empty(positions_shape, dtype=torch.long, device=self.device)
        dist.broadcast(embeds, src=0)
        dist.broadcast(positions, src=0)
        meta = AttentionMetadata.build(
            args["num_tokens"],
            args["starts"],
            args["block_tables"],
            self.block_size,
            pool.num_slots,
            self.device,
            bidirectional_spans=args["spans"],
        )
        if self.lora is not None:
            self._select_lora(args)
        self.adapter.forward(embeds, positions, PagedStep(pool, meta, self.backend))

    def _select_lora(self, args: dict[str, Any]) -> None:
        """Replay rank 0's slot writes, then set each token row's slot as rank 0 did."""
        lora = self.lora
        for slot, adapter in args.get("lora_writes", ()):
            lora.write_slot(slot, adapter)
        slots = args.get("lora_slots")
        if slots is None:
            lora.lm_rows.clear()
            return
        lora.lm_rows.select(slots, repeats=args["num_tokens"], dtype=self.dtype, device=self.device)


def worker_pool_size(worker: WorkerRank, memory: Any = None) -> int:
    """The block count rank 0 sends, after taking part in its KV sizing profiles (each one
    read through ``memory``, an ``engine/execution/device_memory.py`` ``DeviceMemory``; default:
    this
    CUDA device's)."""
    from mmis.engine.execution.device_memory import CudaMemory, rank_fit
    from mmis.engine.execution.paged_attention import PagedKVPool

    spec = worker.adapter.kv_cache_spec(worker.block_size)
    while True:
        message = worker.receive()
        if isinstance(message, int):
            return message
        if message[0] == _STOP:  # rank 0 stopped before its pool existed
            raise SystemExit(0)
        _, num_blocks, fraction, last = message
        if memory is None:
            memory = CudaMemory(worker.device)
        pool = PagedKVPool(spec, num_blocks)
        header = worker.receive()  # the profiling step's own broadcast
        with torch.inference_mode():
            peak = memory.peak_of(lambda h=header, p=pool: worker.forward(h, p))
        del pool
        fit = rank_fit(
            memory, peak, fraction, spec.bytes_per_block, last=last, reserved=worker.reserved
        )
        agree_min([int(fit.fits), fit.blocks], worker.comm)


def worker_main(
    cfg: Any,
    path: str,
    setup_logging: Callable[[str], None],
    rank: int,
    size: int,
    port: int,
    parent: int,
) -> None:
    """A worker rank: load, split, allocate, then mirror rank 0's forwards until told to stop."""
    from mmis.engine.execution.attn_backends import ProbeShape, select_backend
    from mmis.engine.execution.dtype import resolve_dtype
    from mmis.engine.execution.host_memory import keep_freed_memory
    from mmis.engine.execution.model import load_adapter
    from mmis.engine.execution.paged_attention import PagedKVPool

    setup_logging(cfg.log_level)
    keep_freed_memory()  # as rank 0 does (entrypoints/engine.py)
    from mmis.cpus import rank_threads

    torch.set_num_threads(rank_threads(cfg.threads, size))  # as rank 0 does (builder.py)
    device = rank_device(_base_device(cfg), rank)

    def orphan_watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)  # the engine is gone

    threading.Thread(target=orphan_watch, name="tp-orphan", daemon=True).start()

    dtype = resolve_dtype(cfg.dtype, device, path)
    adapter = load_adapter(  # as rank 0 loads it (builder.load_model): LoRA wraps unfused
        path, device=device, dtype=dtype, revision=cfg.revision, fuse=not cfg.enable_lora
    )
    try:
        shard_adapter(adapter, rank, size)
    except TensorParallelError:
        raise SystemExit(UNSPLITTABLE) from None  # rank 0 meets the same error and reports it
    init_group(device, rank, size, port)
    from mmis.engine.execution.cpu_linear import pack_adapter

    pack_adapter(adapter, cfg.cpu_linear)  # as rank 0 does, over this rank's slice
    worker = WorkerRank(
        adapter,
        select_backend(device, cfg.block_size, cfg.attention_backend, shape=ProbeShape.of(adapter)),
        cfg.block_size,
        dtype,
        device,
    )
    if cfg.enable_lora:  # sized before, allocated after the pool (as rank 0: builder.py)
        from mmis.engine.lora.manager import slot_bytes

        worker.reserved = slot_bytes(
            adapter.model,
            max_loras=cfg.max_loras,
            max_rank=cfg.max_lora_rank,
            shards=adapter.tp_shards,
            tower=False,
        )
    pool = PagedKVPool(adapter.kv_cache_spec(cfg.block_size), worker_pool_size(worker))
    if cfg.enable_lora:
        from mmis.engine.lora.manager import LoRAManager

        worker.lora = LoRAManager(
            adapter.model,
            max_loras=cfg.max_loras,
            max_rank=cfg.max_lora_rank,
            shards=adapter.tp_shards,
            tower=False,
        )
    with torch.inference_mode():
        while True:
            header = worker.receive()
            if header[0] == _STOP:
                break
            if header[0] == _PLAIN:
                adapter.reference_logits(header[1])
                continue
            worker.forward(header, pool)
    dist.destroy_process_group()
