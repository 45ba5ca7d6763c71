"""Structured outputs in P1: grammars compiled with xgrammar, one matcher per request attempt,
and the token masks the sampler applies to the logits.

The pieces (``protocol/messages.py`` ``StructuredOutputs`` is what P0 sends):

- :class:`GrammarEngine` holds the model's vocabulary as xgrammar sees it (built once, at
  start-up, from the tokenizer in the model directory: :meth:`GrammarEngine.from_model_dir`)
  and an LRU of compiled grammars keyed by ``(kind, spec)``, at most ``cache_size`` of them.
  :meth:`~GrammarEngine.start` compiles (or finds) a constraint's grammar and returns a fresh
  :class:`GrammarState` for one request attempt; a spec that does not compile raises
  :class:`StructuredOutputError` (``invalid_request``) naming the request parameter that
  carried it, which the core answers at admission.
- :class:`GrammarState` wraps one xgrammar matcher. The request owns it
  (``Request.constraint``, ``engine/scheduling/request.py``) and pushes every output token it
  appends (:meth:`GrammarState.push`); once a stop token is pushed the request stops
  (``finish_reason`` stop).
- The accept worker (:meth:`GrammarEngine.flush`, :meth:`GrammarEngine.settle`): pushed
  tokens are accepted on one background thread, one batched xgrammar call per step, handed
  over by the core after each step's update (``engine/core.py``) so that they run while the
  next forward does; the sampler's :meth:`~GrammarEngine.apply` settles them before it fills
  a mask.
- :meth:`GrammarEngine.apply` is the sampler's step (``engine/execution/sampler.py``): for the rows
whose
  params carry a constraint it fills their bitmask rows in one xgrammar call
  (``BatchGrammarMatcher``, on the host, the GIL released) and sets every disallowed logit to
  ``-inf``: on the CPU with xgrammar's kernel in place, elsewhere by copying the
  ``[rows, ceil(V / 32)]`` int32 masks to the logits' device once and unpacking them there
  (vectorised torch: no device-specific kernel).

Cost (``benchmarks/bench_structured.py``, ``benchmarks/README.md``): the mask is cheap (a few
us per row on the tiny vocabulary); what a large counted repetition with no upper bound
(``X{400,}``, a JSON string's ``minLength``) costs is xgrammar 0.2.9's ``accept_token``
(~100-300 us per token, growing with the count), paid on the accept worker, off the step's
critical path while the forward takes longer. The same language written ``X{n, n} X*`` is
walked in a few us, but xgrammar's masks for it are wrong for some classes (a JSON string, a
negated class between quotes: multi-character tokens refused), so no rewrite here.

Invariants:
- A row finds its state through its params object: the core gives every constrained request
  its own ``SamplingParams`` copy and registers the state under that object's identity; the
  registry holds states weakly and each state holds its params, so an entry lives exactly as
  long as its request and an identity is never reused while it does.
- State is per request attempt: a retried request (a healed drift miss, a new P0 attempt) is
  a new request with a fresh matcher from the cached grammar; preemption keeps the output
  tokens and so the matcher's state.
- A matcher is read (mask fill, :meth:`GrammarState.accept`) only after :meth:`GrammarEngine.
  settle`; between a flush and a settle only the worker touches the flushed states.
- A pushed token's refusal is known at the next settle: the request ends with an error one
  token later (it cannot happen while the mask is applied, which only allows tokens the
  grammar accepts); a pushed stop token ends the state at once, since the mask allowed it
  only where the grammar may end.
- End of sequence: the matcher's stop tokens are the model's EOS ids; when the grammar is
  complete it allows only those, so the request ends with ``stop``. ``max_tokens`` may still
  cut a constrained output short (``length``), as with any output.
- Rows without a constraint cost nothing here (the sampler checks one attribute per row).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from mmis.engine.execution.grammar_sources import choice_source, utf8_only
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode, SamplingParams, StructuredOutputs

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 64
KINDS = ("json", "json_object", "regex", "choice", "grammar")
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Threads of the batched mask fill: one. A fill is a few us per row on the tiny vocabulary;
# xgrammar's pool costs more than that per call on a shared host (measured: 2 threads made a
# 32-row fill ~5x slower), and the host's other cores serve torch.
FILL_THREADS = 1
# A step's accepts go to the worker thread only when the last batch took at least this long;
# cheaper ones run in place at the next settle (a handoff costs GIL traffic: with every batch
# handed over, bench_structured's JSON sides, ~0.1 ms of accepts a step, lost ~4%).
WORKER_MIN_SECONDS = 0.0005


class StructuredOutputError(MMISError, ValueError):
    """A constraint P1 cannot enforce (does not compile, or no grammar engine); not retryable.
    ``param`` names the request parameter that carried it."""

    code = ErrorCode.INVALID_REQUEST.value

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param or None


class GrammarState:
    """One request attempt's position in its grammar (an xgrammar matcher).

    :meth:`accept` advances it now; :meth:`push` (what the request calls, through the
    engine that made the state) queues the token for the engine's accept worker and
    predicts the outcome: see :class:`GrammarEngine` for when the worker runs."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        params: SamplingParams | None = None,
        engine: GrammarEngine | None = None,
    ):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.params = params  # the request's own params object: the sampler's key
        self.rejected = False  # a token the grammar did not allow was appended
        self.ended = False  # a stop token was accepted (or pushed: see push)
        self._engine = engine

    def accept(self, token_id: int) -> bool:
        """Advance by one output token now; ``False`` (and :attr:`rejected`) if not allowed."""
        if self._engine is not None:
            self._engine.settle()  # after any pushed tokens
        if self.rejected or self.ended:
            return not self.rejected
        if not self.matcher.accept_token(int(token_id)):
            self.rejected = True
        self.ended = self.matcher.is_terminated()
        return not self.rejected

    def push(self, token_id: int) -> bool:
        """Advance by one output token, perhaps later (the engine's next :meth:`~GrammarEngine.
        flush`); ``False`` once a refusal is known. A pushed stop token ends the state at once:
        the mask allowed it, so the grammar may end there."""
        if self._engine is None:
            return self.accept(token_id)
        if self.rejected or self.ended:
            return not self.rejected
        if int(token_id) in self._engine.stop_token_ids:
            self.ended = True
        self._engine._queue.append((self, int(token_id)))
        return not self.rejected

    def is_done(self) -> bool:
        """Whether the grammar ended (its stop token accepted): nothing more may follow."""
        return self.ended

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._engine is not None:
            self._engine.settle()
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarEngine:
    """Compiles constraints for one vocabulary, keeps their grammars, masks logits."""

    def __init__(self, info: xgr.TokenizerInfo, *, cache_size: int = DEFAULT_CACHE_SIZE):
        if cache_size < 1:
            raise ValueError("the grammar cache holds at least one grammar")
        self.vocab_size = int(info.vocab_size)
        threads = max(1, min(4, os.cpu_count() or 1))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.num_compiled = 0
        self.num_cache_hits = 0
        self._states: weakref.WeakValueDictionary[int, GrammarState] = weakref.WeakValueDictionary()
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # grows to the batch
        self._filler = xgr.BatchGrammarMatcher(FILL_THREADS)
        self.stop_token_ids = frozenset(int(t) for t in info.stop_token_ids)
        # the accept worker: pushed (state, token) pairs, and the batches handed to it
        self._queue: list[tuple[GrammarState, int]] = []
        self._acceptor = xgr.BatchGrammarMatcher(1)  # the worker's own (never the filler)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: list[concurrent.futures.Future[None]] = []
        self.num_refused = 0
        self.worker_min_seconds = WORKER_MIN_SECONDS
        self._batch_seconds = WORKER_MIN_SECONDS  # the last batch's accept time
        self._bits: dict[torch.device, torch.Tensor] = {}  # 0..31 on each logits device

    @classmethod
    def from_model_dir(
        cls,
        path: str | Path,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        revision: str | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> GrammarEngine:
        """The engine for the tokenizer in ``path`` (its vocabulary padded to the model's
        ``vocab_size``; the model's EOS ids are the grammar's stop tokens)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), revision=revision)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        return cls(info, cache_size=cache_size)

    # -- compile ------------------------------------------------------------------------------
    def compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar of ``constraint`` (cached); else :class:`StructuredOutputError`."""
        kind, spec = constraint.kind, constraint.spec
        key = (kind, "" if kind == "json_object" else spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return compiled
        compiled = self._compile(kind, spec, constraint.param)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, spec: str, param: str) -> xgr.CompiledGrammar:
        what = param or "structured output"
        try:
            if kind in ("json", "json_object"):  # strict: no properties the schema omits
                schema, strict = (spec, True) if kind == "json" else (_JSON_OBJECT_SCHEMA, False)
                grammar = xgr.Grammar.from_json_schema(
                    schema, any_whitespace=False, strict_mode=strict
                )
                return self._compiler.compile_grammar(utf8_only(grammar))
            if kind == "regex":
                return self._compiler.compile_grammar(utf8_only(xgr.Grammar.from_regex(spec)))
            if kind == "choice":
                return self._compiler.compile_grammar(choice_source(spec))
            if kind == "grammar":
                return self._compiler.compile_grammar(spec)
        except Exception as exc:  # xgrammar raises RuntimeError mostly; never crash P1
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            detail = re.sub(r"^(\[[^\]]*\] )?\S+\.(cc|h):\d+: ", "", detail)  # xgrammar's where
            raise StructuredOutputError(
                f"{what}: the {kind} constraint does not compile: {detail}", param
            ) from None
        raise StructuredOutputError(
            f"{what}: unknown constraint kind {kind!r} (one of {', '.join(KINDS)})", param
        )

    def start(self, params: SamplingParams) -> GrammarState:
        """A fresh state for one request attempt whose (own) params are ``params``."""
        if params.structured is None:
            raise StructuredOutputError("the request has no structured-output constraint")
        state = GrammarState(self.compile(params.structured), params, self)
        self._states[id(params)] = state
        return state

    # -- accept -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand the tokens pushed since the last flush to the accept worker (one thread; the
        core calls this after each step's update, so the accepts run while the next step's
        forward does: xgrammar releases the GIL), when accepting is costly enough
        (:data:`WORKER_MIN_SECONDS`)."""
        if not self._queue or self._batch_seconds < self.worker_min_seconds:
            return  # cheap accepts: settle does them in place, no thread handoff
        pairs, self._queue = self._queue, []
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, "mmis-grammar-accept")
        self._in_flight.append(self._worker.submit(self._accept_all, pairs))

    def settle(self) -> None:
        """Wait until every pushed token is accepted (flushed or not): matchers are read only
        after this."""
        in_flight, self._in_flight = self._in_flight, []
        for future in in_flight:
            future.result()
        if self._queue:
            pairs, self._queue = self._queue, []
            self._accept_all(pairs)

    def _accept_all(self, pairs: list[tuple[GrammarState, int]]) -> None:
        """Accept ``pairs`` in order, one batched xgrammar call per round (a state appears at
        most once per round); a refused token marks its state :attr:`~GrammarState.rejected`."""
        started = time.perf_counter()
        while pairs:
            seen: set[int] = set()
            now: list[tuple[GrammarState, int]] = []
            later: list[tuple[GrammarState, int]] = []
            for pair in pairs:
                (later if id(pair[0]) in seen else now).append(pair)
                seen.add(id(pair[0]))
            try:
                oks = self._acceptor.batch_accept_token(
                    [s.matcher for s, _ in now], [t for _, t in now]
                )
            except Exception:  # never let the worker die: the states refuse instead
                log.exception("grammar accept failed for %d state(s)", len(now))
                oks = [False] * len(now)
            for (state, _), ok in zip(now, oks, strict=True):
                if not ok:
                    state.rejected = True
                    self.num_refused += 1
            pairs = later
        self._batch_seconds = time.perf_counter() - started

    # -- mask ---------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, params: Sequence[SamplingParams | None]) -> torch.Tensor:
        """``logits`` with every token a row's grammar does not allow set to ``-inf`` (in place
        for float32 logits); rows without a constraint are untouched."""
        rows = [i for i, p in enumerate(params) if p is not None and p.structured is not None]
        if not rows:
            return logits
        states = []
        for i in rows:
            state = self._states.get(id(params[i]))
            if state is None or state.params is not params[i]:
                raise StructuredOutputError(
                    f"batch row {i} has a constraint but no grammar state (an engine bug)"
                )
            states.append(state)
        self.settle()
        if self._bitmask.shape[0] < len(params):
            self._bitmask = xgr.allocate_token_bitmask(len(params), self.vocab_size)
        bitmask = self._bitmask[: len(params)]  # row i is batch row i's (constrained rows only)
        self._filler.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)
        width = min(logits.shape[1], self.vocab_size)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
            if logits.shape[1] > width:  # ids past the grammar's vocabulary: never
                logits[rows, width:] = float("-inf")
            return logits
        return self._apply_unpacked(logits, bitmask, rows, width)

    def _apply_unpacked(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], width: int
    ) -> torch.Tensor:
        """The mask on any device: the words copied over once and unpacked with torch."""
        device = logits.device
        bits = self._bits.get(device)
        if bits is None:
            bits = self._bits[device] = torch.arange(32, dtype=torch.int32, device=device)
        words = (bitmask if len(rows) == logits.shape[0] else bitmask[rows]).to(device)
        allowed = ((words.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :width].bool()
        if logits.shape[1] > width:  # ids past the grammar's vocabulary: never
            pad = torch.zeros(len(rows), logits.shape[1] - width, dtype=torch.bool, device=device)
            allowed = torch.cat([allowed, pad], dim=1)
        if len(rows) == logits.shape[0]:
            return logits.masked_fill_(~allowed, float("-inf"))
        index = torch.tensor(rows, device=device)
        masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        return logits.index_copy_(0, index, masked)

    def stats(self) -> dict[str, Any]:
        return {
            "grammars_cached": len(self._cache),
            "grammars_compiled": self.num_compiled,
            "grammar_cache_hits": self.num_cache_hits,
            "grammar_tokens_refused": self.num_refused,
        }
