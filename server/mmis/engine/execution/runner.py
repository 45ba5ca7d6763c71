"""The batched model runner: one forward pass per scheduling step.

A step, in order: drop freed encoder outputs and ended requests' state; run the vision
encoder ONCE for every item not yet stored (``encoder_store.py``; an item that brought its
encoder output, ``MM_EMBEDS``, is stored as it is: E/PD); embed all scheduled tokens packed as
one sequence and overwrite each image's placeholder rows with its embeddings; run the
language model once with paged attention over the KV pool; sample after the last token of
every chunk that asks for it (``sampler.py``); then, for the rows that ask, prompt logprobs
and pooled vectors (``step_extras.py``). Rows with a presence/frequency/repetition penalty
also need the request's token history: the caller passes the requests themselves
(``histories``: request id -> an object with ``prompt_token_ids`` and ``output_token_ids``,
the core passes the scheduler's requests), read only, through its ``TokenHistoryCache``
(``engine/execution/token_history.py``).

Invariants:
- Exactly one language-model forward per step, whatever the number of sequences; under
  tensor parallelism the step's inputs are broadcast right before it, so every rank runs
  the same forward (``tensor_parallel.py``). With ``decode_graphs`` set (``mmis engine`` on
  CUDA, not under tensor parallelism) a step of decode rows only runs that forward as a
  fixed-shape replay of a captured CUDA graph (``decode_graphs.py``); every other step eager.
- The step's attention metadata (block tables, cumulative lengths, new-token slots,
  positions: ``attn_metadata.py``) is built once by ``step_builder.build_step``, vectorised,
  before the forward, from the
  runner's persistent block tables (``block_tables.BlockTables``: a request's row gains only
  its new block ids; ended requests release theirs), and every host input of the step (token
  ids, sample rows, metadata, M-RoPE positions: ``ModelAdapter.host_positions``) goes to the
  device in one copy; the
  attention backend (``attn_backends.py``, chosen per device at construction) reads it in
  every layer. ``hidden`` keeps every packed row, so logits at any prompt position (prompt
  logprobs) are one ``compute_logits`` away.
- The encoder runs at most once per mm_hash while it stays in the store
  (``encoder_store.py``; the scheduler frees it through ``freed_encoder_hashes``).
- With ``lora`` set (``--enable-lora``, ``engine/lora/``) every step puts its distinct
  adapters on device slots and sets each token row's slot before the forward (a base-only step
  clears them); images are encoded in one call per adapter that changes the tower (the base
  tower for the rest), whose items the scheduler keys with the adapter
  (``scheduling/request.py`` ``encoder_key``); a step with LoRA rows never replays a CUDA graph.
  Under tensor parallelism the step's broadcast carries the slot writes since the last one and
  each sequence's slot, so every rank applies the same adapters (``engine/lora/manager.py``).
- It reads the scheduler's :class:`SchedulerOutput` as is (``sched_output.py``).
- Per-request state is only the partial sum of mean-pooling requests whose prompt spans
  several chunks, the device token counts of requests with penalties (always equal to
  their token lists, see ``sampler.py``) and the block table rows; ``ended_request_ids``
  drops all three.
- Inconsistent input raises a typed :class:`StepInputError` (``step_errors.py``; or the
  adapter's ``ModelInputError``) before the KV pool is written.
- A step is :meth:`ModelRunner.launch` then :meth:`ModelRunner.collect` (:meth:`execute` is
  both). ``launch`` enqueues the encoder, the forward and the sampling and starts the sampled
  ids' copy to the host (``async_output.py``: a copy stream and an event on CUDA); nothing in
  it waits for the device on a plain step (rows that need logprobs or pooling vectors read
  them in ``collect``; prompt logprobs and pooling still read theirs in ``launch``).
  ``collect`` waits for that copy and fills ``StepOutput.sampled`` (and logprobs). Between
  the two the next step may be launched (async scheduling, ``engine/core.py``): a row in its
  ``pending_rows`` takes its token id from the sampled ids of the step launched just before
  (kept on the device, with its step number), by an index copy on the device: no host sync,
  and the host never sees that token before that step's ``collect``.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmis.engine.execution import logprobs
from mmis.engine.execution.async_output import SampledCopies, SampledCopy
from mmis.engine.execution.attn_backends import AttentionBackend, ProbeShape, select_backend
from mmis.engine.execution.block_tables import BlockTables
from mmis.engine.execution.encoder_store import EncoderStore
from mmis.engine.execution.model.adapter import ModelAdapter
from mmis.engine.execution.paged_attention import DEFAULT_BLOCK_SIZE, PagedKVPool, PagedStep
from mmis.engine.execution.sampler import Sampler
from mmis.engine.execution.step_builder import HostToDevice, build_step
from mmis.engine.execution.step_errors import StepInputError
from mmis.engine.execution.step_extras import StepExtras
from mmis.engine.execution.token_history import TokenCounts, TokenHistory, TokenHistoryCache
from mmis.engine.scheduling.sched_output import (
    PLACEHOLDER_TOKEN,
    ScheduledRequest,
    SchedulerOutput,
    StepOutput,
    identity,
)
from mmis.protocol.messages import SamplingParams

if TYPE_CHECKING:
    from mmis.engine.execution.decode_graphs import DecodeGraphs
    from mmis.engine.execution.tensor_parallel import TensorParallel
    from mmis.engine.lora.manager import LoRAManager


_REQUEST_ID = operator.attrgetter("request_id")
_PROMPT_LOGPROBS = operator.attrgetter("prompt_logprobs")


def _largest_unsigned(ids: np.ndarray) -> int:
    """The largest of ``ids`` (int64, not empty) read as unsigned: a negative id counts as
    2**63 or more, so one reduction bounds both ends of the vocabulary."""
    return int(np.maximum.reduce(ids.view(np.uint64)))


@dataclasses.dataclass(slots=True)
class LaunchedStep:
    """A step :meth:`ModelRunner.launch` enqueued: its output without the sampled ids (and
    logprobs) that :meth:`ModelRunner.collect` adds once their copy completed."""

    out: StepOutput
    sampled: SampledCopy | None = None
    logprobs: logprobs.Pending | None = None
    sampled_device: torch.Tensor | None = None  # what logprobs.finish reads


class ModelRunner:
    def __init__(
        self,
        adapter: ModelAdapter,
        pool: PagedKVPool,
        sampler: Sampler | None = None,
        backend: AttentionBackend | None = None,
    ):
        self.adapter = adapter
        self.pool = pool
        self.backend = backend or select_backend(
            adapter.device, pool.block_size, shape=ProbeShape.of(adapter)
        )
        self.sampler = sampler or Sampler()
        self.encoders = EncoderStore(adapter)  # encoder outputs by key (encoder_store.py)
        self.extras = StepExtras(adapter)  # prompt logprobs, pooling (step_extras.py)
        self.token_history = TokenHistoryCache()
        # persistent per-request block table rows and the step's one host->device copy
        self.block_tables = BlockTables(pool.block_size, pool.num_slots, adapter.device)
        self.upload = HostToDevice(adapter.device)
        self.copies = SampledCopies(adapter.device)
        # the sampled ids of the step launched last, on the device, and its step number: the
        # source of the next step's ``pending_rows`` (async scheduling)
        self._prev_sampled: torch.Tensor | None = None
        self._prev_step = -1
        self.num_forwards = 0
        # set by ``mmis engine`` under --tensor-parallel-size > 1
        # (engine/execution/tensor_parallel.py)
        self.tensor_parallel: TensorParallel | None = None
        # set by ``mmis engine`` on CUDA unless --enforce-eager (engine/execution/decode_graphs.py)
        self.decode_graphs: DecodeGraphs | None = None
        # set under --enable-lora (engine/lora/): each row's adapter, per step
        self.lora: LoRAManager | None = None
        self._lora_slots: dict[str | None, int] = {None: 0}

    @classmethod
    def create(
        cls,
        adapter: ModelAdapter,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        kv_budget_bytes: int | None = None,
        attention_backend: str = "auto",
    ) -> ModelRunner:
        spec = adapter.kv_cache_spec(block_size)
        pool = PagedKVPool.from_budget(spec, num_blocks=num_blocks, budget_bytes=kv_budget_bytes)
        backend = select_backend(
            adapter.device, block_size, attention_backend, shape=ProbeShape.of(adapter)
        )
        return cls(adapter, pool, backend=backend)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def encoder_outputs(self) -> dict[str, torch.Tensor]:
        return self.encoders.outputs

    @property
    def num_encoder_calls(self) -> int:
        return self.encoders.num_calls

    @torch.inference_mode()
    def execute(
        self, batch: SchedulerOutput, histories: Mapping[str, TokenHistory] | None = None
    ) -> StepOutput:
        """Run one step; ``histories`` is required when a sampled row has a penalty."""
        return self._collect(self._launch(batch, histories))

    @torch.inference_mode()
    def collect(self, launched: LaunchedStep) -> StepOutput:
        """The launched step's output, once its sampled ids are on the host (a step with
        logprobs reads them here, behind whatever was launched since)."""
        return self._collect(launched)

    @torch.inference_mode()
    def launch(
        self, batch: SchedulerOutput, histories: Mapping[str, TokenHistory] | None = None
    ) -> LaunchedStep:
        """Enqueue one step (see the module docstring); :meth:`collect` gives its output.
        ``histories`` is required when a sampled row has a penalty; they must hold every
        token of those rows (the core never launches such a row over a placeholder)."""
        return self._launch(batch, histories)

    def _collect(self, launched: LaunchedStep) -> StepOutput:
        out = launched.out
        if launched.sampled is not None:
            out.sampled = launched.sampled.tolist()
        if launched.logprobs is not None and launched.sampled_device is not None:
            for row, lp in logprobs.finish(launched.logprobs, launched.sampled_device).items():
                out.logprobs[out.sampled_ids[row]] = lp
        return out

    def _launch(
        self, batch: SchedulerOutput, histories: Mapping[str, TokenHistory] | None
    ) -> LaunchedStep:
        out = StepOutput()
        launched = LaunchedStep(out)
        if batch.freed_encoder_hashes:
            self.encoders.free(batch.freed_encoder_hashes)
        ended = batch.ended_request_ids
        if ended:  # most steps end nothing
            self.extras.drop(ended)
            self.token_history.drop(ended)
            self.block_tables.release(ended)
        seqs = list(batch.scheduled)
        if not seqs:
            return launched
        # every later stage reads columns: one transpose of the rows (named tuples)
        (
            ids,
            chunks,
            starts,
            tables,
            mm_items,
            samples,
            params_all,
            poolings,
            _,
            encode,
            plains,
            lora_names,
        ) = zip(*seqs, strict=True)
        sizes = list(map(len, chunks))
        offset = sum(sizes)
        token_ids = list(itertools.chain.from_iterable(chunks))
        items = any(mm_items) or any(encode)
        plain = all(plains)  # no pooling, logprobs, penalties: checked per request
        pooling = not plain and poolings.count(None) != len(seqs)
        extras = not plain and (
            pooling
            or None in params_all
            or list(map(_PROMPT_LOGPROBS, params_all)).count(None) != len(params_all)
        )
        if not pooling and all(samples):  # every chunk samples (every decode step)
            chosen = seqs
            # every packed row samples (a decode step): no gather, no rows to upload
            everything = offset == len(seqs)
            sample_rows = [] if everything else list(itertools.accumulate(sizes, initial=-1))[1:]
        else:
            chosen, sample_rows, end = [], [], 0
            for s, size in zip(seqs, sizes, strict=True):
                end += size
                if s.pooling_params is None and s.sample:
                    sample_rows.append(end - 1)
                    chosen.append(s)
            everything = len(sample_rows) == offset
        # async scheduling: ``replace`` when every token is the previous step's sampled id of
        # the same row (the steady state), else ``patch`` (destinations, sources) of some
        replace: torch.Tensor | None = None
        patch = None
        if batch.pending_rows:
            prev = self._pending_source(batch)
            count = len(batch.pending_rows)
            if count == offset and batch.pending_sources is identity(count):
                replace = prev[:count]
                flat = np.zeros(offset, dtype=np.int64)
            else:
                flat = np.array(token_ids, dtype=np.int64)
                patch = self._pending_tokens(batch, sizes, flat, prev)
        else:
            flat = np.array(token_ids, dtype=np.int64)
        vocab = self.adapter.vocab_size
        if (
            items
            or min(sizes) == 0
            or len(set(ids)) != len(ids)
            or (replace is None and flat.size and _largest_unsigned(flat) >= vocab)
        ):
            self._validate(seqs)  # raises the first problem, as the checks run row by row
        spans = self.adapter.bidirectional_spans(seqs)
        # the step's extra host arrays, in this order: token ids, the sampled rows (unless
        # ``everything``), M-RoPE positions (if any), the placeholders' patch (if any)
        extra = [(flat, torch.long)]
        if not everything:
            extra.append((np.array(sample_rows, dtype=np.int64), torch.long))
        host_positions = self.adapter.host_positions(seqs)  # M-RoPE: in the one upload too
        if host_positions is not None:
            extra.append((host_positions, torch.long))
        if patch is not None:
            extra += [(patch[0], torch.long), (patch[1], torch.long)]
        meta, uploaded = build_step(
            sizes,
            starts,
            ids,
            tables,
            self.block_tables,
            self.upload,
            bidirectional_spans=spans,
            extra=extra,
        )
        token_tensor = uploaded[0]
        # the placeholders: the previous step's sampled ids, on the device, no host sync
        if replace is not None:
            token_tensor = replace
        elif patch is not None:
            dst, src = uploaded[-2], uploaded[-1]
            token_tensor.index_copy_(0, dst, patch[2].index_select(0, src))
        lora = self.lora
        lora_active = lora is not None and lora_names.count(None) != len(seqs)
        if lora is not None:  # every step sets (or clears) the rows' slots
            self._select_lora(lora, lora_names if lora_active else (), sizes)
        out.encoded_mm_hashes = self.encoders.encode(seqs, lora, self._lora_slots) if items else []
        embeds = self.adapter.embed_tokens(token_tensor)
        if items:
            self.encoders.scatter(embeds, seqs)
        positions = (
            meta.positions.unsqueeze(0)
            if host_positions is None
            else uploaded[1 if everything else 2].unsqueeze(-2)
        )
        if self.tensor_parallel is not None:  # the other ranks run the same forward
            lora_writes, lora_slots = [], None
            if lora is not None:  # they replay the slot writes and use the same slots
                lora_writes = lora.take_writes()
                if lora_active:
                    lora_slots = [self._lora_slots[n] for n in lora_names]
            self.tensor_parallel.broadcast_step(
                sizes,
                starts,
                tables,
                spans,
                embeds,
                positions,
                lora_writes=lora_writes,
                lora_slots=lora_slots,
            )
        graphs = self.decode_graphs
        if (
            graphs is not None
            and self.tensor_parallel is None
            and not lora_active  # graphs are captured without LoRA rows
            and graphs.usable(seqs, meta)
        ):
            hidden = graphs.forward(embeds, positions, meta)
        else:
            step = PagedStep(self.pool, meta, self.backend)
            hidden = self.adapter.forward(embeds, positions, step)
        self.num_forwards += 1
        if chosen:
            out.sampled_ids = ids if chosen is seqs else list(map(_REQUEST_ID, chosen))
            if chosen is seqs:  # each row's end position: where its sampled token goes
                ends = list(map(operator.add, starts, sizes))
            else:
                ends = [s.start_position + len(s.token_ids) for s in chosen]
            rows = hidden if everything else hidden[uploaded[1]]
            params = params_all if chosen is seqs else [s.sampling_params for s in chosen]
            sampled, launched.logprobs = self._sample(rows, chosen, params, ends, histories, plain)
            launched.sampled = self.copies.start(sampled)
            if launched.logprobs is not None:
                launched.sampled_device = sampled
            self._prev_sampled, self._prev_step = sampled, batch.step
        else:
            self._prev_sampled = None
        if extras:
            self.extras.run(hidden, seqs, out, histories)
        return launched

    # -- steps -----------------------------------------------------------------------------
    def _pending_source(self, batch: SchedulerOutput) -> torch.Tensor:
        """The previous step's sampled ids, which ``batch.pending_rows`` read (checked: that
        step was the one launched last, and it sampled enough rows)."""
        prev, sources = self._prev_sampled, batch.pending_sources
        if (
            prev is None
            or self._prev_step != batch.step - 1
            or len(sources) != len(batch.pending_rows)
            or min(sources) < 0
            or max(sources) >= prev.shape[0]
        ):
            raise StepInputError(
                f"step {batch.step}: {len(batch.pending_rows)} row(s) wait for sampled ids of "
                f"step {batch.step - 1}, which the runner did not just launch (last: "
                f"{self._prev_step}, {0 if prev is None else prev.shape[0]} ids)"
            )
        return prev

    @staticmethod
    def _pending_tokens(
        batch: SchedulerOutput, sizes: Sequence[int], flat: np.ndarray, prev: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """The packed index of each placeholder (``batch.pending_rows``: a row's last token),
        its row among the previous step's sampled ids (``prev``) and ``prev``; the
        placeholders in ``flat`` are set to 0 (a valid id for the checks; the device gets the
        sampled one)."""
        rows = np.asarray(batch.pending_rows, dtype=np.int64)
        dst = np.cumsum(np.asarray(sizes, dtype=np.int64))[rows] - 1
        if (flat[dst] != PLACEHOLDER_TOKEN).any():
            raise StepInputError(f"step {batch.step}: a pending row does not end in a placeholder")
        flat[dst] = 0
        return dst, np.asarray(batch.pending_sources, dtype=np.int64), prev

    def _validate(self, seqs: Sequence[ScheduledRequest]) -> None:
        ids = [s.request_id for s in seqs]
        if len(set(ids)) != len(ids):
            raise StepInputError(f"a request is scheduled twice in one step: {ids}")
        vocab = self.adapter.vocab_size
        for s in seqs:
            s.check_encoder_inputs()
            if not s.token_ids:
                raise StepInputError(f"request {s.request_id}: no tokens scheduled")
            if s.token_ids[-1] == PLACEHOLDER_TOKEN:  # set on the device (``_pending_tokens``)
                s = s._replace(token_ids=[*s.token_ids[:-1], 0])
            if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
                raise StepInputError(f"request {s.request_id}: token id outside [0, {vocab})")
            for item in s.mm_items:
                if item.length < 1 or item.offset < 0:
                    raise StepInputError(
                        f"request {s.request_id}: bad placeholder {item.offset}+{item.length}"
                    )

    def _select_lora(
        self, lora: LoRAManager, names: Sequence[str | None], sizes: Sequence[int]
    ) -> None:
        """Put each distinct adapter of the step on a device slot and set every token row's
        slot (engine/lora/; ``names`` empty: a base-only step, the rows are cleared). The
        adapters are pinned only while the step's adapters are acquired (so one cannot evict
        another of the same step) and released at once: a slot is rewritten only by a later
        step's acquire, which the device runs after this step's forward (one stream)."""
        slots: dict[str | None, int] = {None: 0}
        try:
            for name in names:
                if name is not None and name not in slots:
                    slots[name] = lora.acquire(name)
        finally:
            for name in slots:
                if name is not None:
                    lora.release(name)
        self._lora_slots = slots
        if not names:
            lora.lm_rows.clear()
            return
        lora.lm_rows.select(
            [slots[n] for n in names],
            repeats=sizes,
            dtype=self.adapter.dtype,
            device=self.adapter.device,
        )

    def _sample(
        self,
        hidden: torch.Tensor,
        chosen: Sequence[ScheduledRequest],
        params: Sequence[SamplingParams | None],
        positions: Sequence[int],
        histories: Mapping[str, TokenHistory] | None,
        plain: bool,
    ) -> tuple[torch.Tensor, logprobs.Pending | None]:
        """Sample after the last row of every ``chosen`` chunk (``hidden``: those rows;
        ``params``, ``positions``: their sampling params and end positions; ``plain``:
        every row ``is_plain``, so no history, logprobs or per-row checks); returns the
        sampled ids (1-D int64, on the device) and the logprobs still to read."""
        logits = self.adapter.compute_logits(hidden)
        if plain:
            counts, pending = None, None
        else:
            counts = self._token_counts(chosen, histories, logits)
            pending = logprobs.prepare(logits, params)  # before the sampler touches the logits
        return self.sampler(logits, params, positions, counts, plain=plain), pending

    def _token_counts(
        self,
        chosen: Sequence[ScheduledRequest],
        histories: Mapping[str, TokenHistory] | None,
        logits: torch.Tensor,
    ) -> TokenCounts | None:
        rows, ids, repetition = [], [], False
        for k, s in enumerate(chosen):
            params = s.sampling_params
            if params is not None and (  # needs_history, inlined (a check per row per step)
                params.presence_penalty != 0
                or params.frequency_penalty != 0
                or params.repetition_penalty != 1
            ):
                rows.append(k)
                ids.append(s.request_id)
                repetition = repetition or params.repetition_penalty != 1
        if not rows:
            return None
        missing = [rid for rid in ids if histories is None or rid not in histories]
        if histories is None or missing:
            raise StepInputError(f"requests {missing}: penalties need their token history")
        return self.token_history.counts(
            rows,
            ids,
            [histories[rid] for rid in ids],
            with_prompt=repetition,
            vocab_size=logits.shape[-1],
            device=logits.device,
        )
