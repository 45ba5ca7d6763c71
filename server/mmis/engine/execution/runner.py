"""The batched model runner: one forward pass per scheduling step.

Per step it: drops freed encoder outputs; runs the vision encoder ONCE for every item that
brought tensors and is not yet stored (an item that brought its encoder output, ``MM_EMBEDS``,
is stored as it is: E/PD); embeds all scheduled tokens packed as one sequence;
overwrites each image's placeholder rows with its embeddings (a chunk may start or end inside
a placeholder range); runs the language model once with paged attention over the KV pool;
samples after the last token of every chunk that asks for it, and pools for pooling requests.
Rows with a presence/frequency/repetition penalty also need the request's token history: the
caller passes the requests themselves (``histories``: request id -> an object with
``prompt_token_ids`` and ``output_token_ids``, the core passes the scheduler's requests), read
only, through its ``TokenHistoryCache`` (``engine/execution/token_history.py``).
Prompt logprobs (``SamplingParams.prompt_logprobs``): for such a request that has no output
token yet, the logits of every scheduled row before the prompt's last token score the NEXT
prompt token (read from ``histories``: a chunk's last row scores the first token of the next
chunk), in ``StepOutput.prompt_logprobs``; the core joins the chunks.

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
- The encoder runs at most once per mm_hash while it stays in the store (the scheduler frees
  it through ``freed_encoder_hashes``).
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
- Inconsistent input raises a typed :class:`StepInputError` (or the adapter's
  ``ModelInputError``) before the KV pool is written.
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
from mmis.engine.execution.model.adapter import ModelAdapter
from mmis.engine.execution.paged_attention import DEFAULT_BLOCK_SIZE, PagedKVPool, PagedStep
from mmis.engine.execution.sampler import Sampler
from mmis.engine.execution.step_builder import HostToDevice, build_step
from mmis.engine.execution.token_history import TokenCounts, TokenHistory, TokenHistoryCache
from mmis.engine.scheduling.sched_output import (
    PLACEHOLDER_TOKEN,
    ScheduledRequest,
    SchedulerOutput,
    StepOutput,
    identity,
)
from mmis.protocol.encoder import MM_EMBEDS
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode, SamplingParams

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


class StepInputError(MMISError, ValueError):
    """A step the runner cannot execute (a scheduler/glue bug or bad request data)."""

    code = ErrorCode.INVALID_REQUEST.value


class EncoderOutputMissingError(StepInputError):
    """A chunk overlaps an item whose embeddings are neither stored nor given tensors."""

    code = ErrorCode.INTERNAL.value


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
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self._pool_sums: dict[str, tuple[torch.Tensor, int]] = {}
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
        self.num_encoder_calls = 0
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
        for mm_hash in batch.freed_encoder_hashes:
            self.encoder_outputs.pop(mm_hash, None)
        ended = batch.ended_request_ids
        if ended:  # most steps end nothing
            for request_id in ended:
                self._pool_sums.pop(request_id, None)
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
        out.encoded_mm_hashes = self._encode(seqs) if items else []
        embeds = self.adapter.embed_tokens(token_tensor)
        if items:
            self._scatter(embeds, seqs)
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
            self._prompt_logprobs(hidden, seqs, out, histories)
            self._pool(hidden, seqs, out)
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

    def _tower_groups(self, seqs: Sequence[ScheduledRequest]) -> dict[str, str | None]:
        """mm_hash -> the adapter its encoder call runs under (None: the base tower; also for
        adapters that leave the tower alone)."""
        lora = self.lora
        if lora is None:
            return {}
        return {
            item.mm_hash: s.lora_name if lora.changes_tower(s.lora_name) else None
            for s in seqs
            for item in s.mm_items
        }

    def _encode_under(self, lora_name: str | None, datas: list[object]) -> list[torch.Tensor]:
        lora = self.lora
        if lora is None or lora_name is None:
            return self.adapter.encode_images(datas)  # type: ignore[arg-type]
        slot = self._lora_slots[lora_name]  # pinned by _select_lora for this step
        lora.tower_rows.select([slot], dtype=self.adapter.dtype, device=self.adapter.device)
        try:
            return self.adapter.encode_images(datas)  # type: ignore[arg-type]
        finally:
            lora.tower_rows.clear()

    def _encode(self, seqs: Sequence[ScheduledRequest]) -> list[str]:
        """Store the encoder output of every item that brought tensors and is not stored yet;
        returns their hashes. An item that brought its encoder output (``MM_EMBEDS``, checked
        by P1's input thread, ``engine/encoder_inputs.py``) is stored as it is, moved to the
        model's device and dtype; the tower runs, once, only for the rest."""
        todo: dict[str, tuple[int, object]] = {}
        given: list[str] = []
        for s in seqs:
            for item in s.mm_items:
                if item.data is None or item.mm_hash in self.encoder_outputs:
                    continue
                if MM_EMBEDS in item.data:
                    embeds = torch.as_tensor(item.data[MM_EMBEDS])
                    self._store_output(item.mm_hash, item.length, embeds)
                    given.append(item.mm_hash)
                    continue
                todo.setdefault(item.mm_hash, (item.length, item.data))
        if not todo:
            return given
        hashes = list(todo)
        groups = self._tower_groups(seqs)
        by_lora: dict[str | None, list[str]] = {}
        for mm_hash in hashes:  # one encoder call per adapter that changes the tower
            by_lora.setdefault(groups.get(mm_hash), []).append(mm_hash)
        for lora_name, group in by_lora.items():
            embeddings = self._encode_under(lora_name, [todo[h][1] for h in group])
            self.num_encoder_calls += 1
            for mm_hash, emb in zip(group, embeddings, strict=True):
                self._store_output(mm_hash, todo[mm_hash][0], emb)
        return given + [h for group in by_lora.values() for h in group]

    def _store_output(self, mm_hash: str, length: int, emb: torch.Tensor) -> None:
        if emb.shape[0] != length:
            raise StepInputError(
                f"item {mm_hash}: encoder gave {emb.shape[0]} embeddings for a placeholder "
                f"of {length} tokens"
            )
        self.encoder_outputs[mm_hash] = emb.to(self.adapter.device, self.adapter.dtype)

    def _scatter(self, embeds: torch.Tensor, seqs: Sequence[ScheduledRequest]) -> None:
        offset = 0
        for s in seqs:
            start, end = s.start_position, s.end_position
            for item in s.mm_items:
                lo, hi = max(item.offset, start), min(item.end, end)
                if lo >= hi:
                    continue
                stored = self.encoder_outputs.get(item.mm_hash)
                if stored is None:
                    raise EncoderOutputMissingError(
                        f"request {s.request_id}: no encoder output for item {item.mm_hash}"
                    )
                rows = stored[lo - item.offset : hi - item.offset]
                embeds[offset + lo - start : offset + hi - start] = rows.to(embeds.dtype)
            offset += s.num_tokens

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

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        seqs: Sequence[ScheduledRequest],
        out: StepOutput,
        histories: Mapping[str, TokenHistory] | None,
    ) -> None:
        offset = 0
        for s in seqs:
            base, offset = offset, offset + s.num_tokens
            params = s.sampling_params
            if params is None or params.prompt_logprobs is None or s.pooling_params is not None:
                continue
            request = None if histories is None else histories.get(s.request_id)
            if request is None:
                raise StepInputError(f"request {s.request_id}: prompt logprobs need its prompt")
            if request.output_token_ids:  # sent with the first output already
                continue
            prompt = request.prompt_token_ids
            end = min(s.end_position, len(prompt) - 1)  # rows before the last prompt token
            lp = logprobs.first_prompt_row(prompt[0]) if s.start_position == 0 else None
            if end > s.start_position:
                logits = self.adapter.compute_logits(hidden[base : base + end - s.start_position])
                rows = logprobs.score(
                    logits, prompt[s.start_position + 1 : end + 1], params.prompt_logprobs
                )
                if lp is None:
                    lp = rows
                else:
                    lp.token_ids.extend(rows.token_ids)
                    lp.logprobs.extend(rows.logprobs)
                    lp.ranks.extend(rows.ranks)
            if lp is not None:
                out.prompt_logprobs[s.request_id] = (
                    0 if s.start_position == 0 else s.start_position + 1,
                    lp,
                )

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

    def _pool(
        self, hidden: torch.Tensor, seqs: Sequence[ScheduledRequest], out: StepOutput
    ) -> None:
        offset = 0
        for s in seqs:
            rows = hidden[offset : offset + s.num_tokens].float()
            offset += s.num_tokens
            params = s.pooling_params
            if params is None:
                continue
            if params.pooling_type == "last":
                vector = rows[-1] if s.sample else None
            elif params.pooling_type == "mean":
                vector = self._mean(s, rows)
            else:
                raise StepInputError(f"unknown pooling_type {params.pooling_type!r}")
            if vector is None:
                continue
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            out.pooled[s.request_id] = vector.cpu().numpy().astype(np.float32)

    def _mean(self, s: ScheduledRequest, rows: torch.Tensor) -> torch.Tensor | None:
        total, count = self._pool_sums.pop(s.request_id, (None, 0))
        if total is None and s.start_position != 0:
            raise StepInputError(
                f"request {s.request_id}: mean pooling needs every prompt token computed "
                "(start at 0; no prefix-cache hit)"
            )
        total = rows.sum(dim=0) if total is None else total + rows.sum(dim=0)
        count += rows.shape[0]
        if not s.sample:
            self._pool_sums[s.request_id] = (total, count)
            return None
        return total / count
