"""From a prepared prompt to finished outputs with text: P0's output processor.

``frontend/api`` hands a :class:`GenerateRequest` (plain data: the request id, the endpoint,
the wire :class:`~mmis.protocol.messages.SamplingParams` of every choice and the client's token
cap) and a :class:`~mmis.frontend.client.renderer.SourcePrompt`; this module builds one engine
request per choice, runs them through the recovery policy (``frontend/client/recovery.py``: the
render, the one retry), detokenizes each choice incrementally, matches stop strings and turns
logprobs into text rows, and gives back either a whole :class:`Completion` or an
:class:`OutputStream` of :class:`ChoiceDelta` s. ``api`` only shapes them (vLLM's output
processor is the model: the engine client yields outputs with text; the API server formats).

Invariants:
- Data flows one way: ``api`` calls this module with data, never with a callable, and nothing
  here calls into ``api`` (an import-linter contract in ``pyproject.toml``; at run time
  ``tests/e2e/test_request_walk.py`` and ``tests/frontend/test_output_processor.py``).
- P0 is the only owner of ``n``: ``n`` choices are ``n`` sibling engine requests with
  ``n=1`` each (choice ``i`` gets seed ``(seed + i) mod 2**63`` when a seed is given; P1
  refuses ``n != 1``), so one choice can be stopped, aborted or retried on its own. Without a
  token cap a choice may use the context window the rendered prompt leaves (at least 1).
- P0 is the only owner of stop strings (P1 applies stop token ids only): each choice's
  :class:`IncrementalDetokenizer` matches them as tokens arrive, in streams and in whole
  responses alike; the text stops right before the match, ``finish_reason`` is ``stop`` and
  the sibling is aborted in P1 at once. A whole response reuses the detokenizers that
  watched its outputs arrive, so each choice is decoded once (none watch without stop
  strings: nothing can end a choice early, so it is decoded once, whole, at the end).
- A stream starts (:meth:`OutputProcessor.stream` returns) only once every sibling produced
  its first output, so the HTTP status is decided before any byte; a later failure raises its
  typed error from :meth:`OutputStream.deltas`, and every exit path aborts the siblings still
  running in P1 (:meth:`OutputStream.aclose`).
- Usage (prompt, completion and cached tokens) counts the tokens the answer keeps: up to the
  output that completed a stop string; it is noted on the request's telemetry record once.

Detokenizing (:class:`IncrementalDetokenizer`) costs time in the new tokens and the held-back
tail only, never in the whole output: text is decoded over a small window (the tokens of the
previous delta as context, then the new ones, as vLLM does), and stop strings are searched in
the held-back tail plus the new text. Its invariants:
- The text emitted so far is a prefix of the choice's text cut at the first stop string:
  deltas concatenate to the final text.
- A decoded tail that ends in U+FFFD (an incomplete UTF-8 sequence of a byte-level BPE) is
  held back until the next token completes it, or until the choice finishes.
- The held-back tail is the longest suffix that is a proper prefix of a stop string (so
  shorter than the longest stop), so a stop string is never partly streamed and any later
  match starts inside the tail or the new text; once one matches, the text stops right before
  it and :attr:`IncrementalDetokenizer.stopped_by` names it.

Logprobs (:class:`LogprobsBuilder`): P1 computes the numbers (``engine/execution/logprobs.py``);
here each token id becomes its text (the tokenizer's decoding of that one token, special
tokens included, as vLLM shows them). Its invariants:
- One :class:`TokenLogprob` per generated token the answer keeps, in order: a choice cut by
  a stop string keeps the rows of the tokens before the cut only.
- ``offset`` is the position of the token's text in the choice's concatenated token texts
  (completions' ``text_offset``), running across the deltas of a stream.
- Prompt logprobs (completions ``echo`` with ``logprobs``): the rows of the first output's
  ``prompt_logprobs`` come first, one per prompt token, the first without a value
  (``TokenLogprob.first``); the generated rows' offsets continue after them. They are kept
  apart from :attr:`LogprobsBuilder.rows` (the generated tokens only):
  :meth:`LogprobsBuilder.kept` and :meth:`LogprobsBuilder.delta` (once, in a stream's first
  delta of the choice) put them in front.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from mmis.frontend.client.generation import Generation, RetryableFailure
from mmis.frontend.client.processor import ModelProcessor
from mmis.frontend.client.recovery import ChoiceWatch, RecoveryPolicy
from mmis.frontend.client.renderer import RenderedPrompt, SourcePrompt
from mmis.frontend.request_telemetry import current_record
from mmis.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)

SEED_MODULUS = 2**63
_REPLACEMENT = "\ufffd"


# ------------------------------------------------------------------ detokenizing
class IncrementalDetokenizer:
    """One choice's text, decoded as its tokens arrive (the module's detokenizing rules)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self._prefix = 0  # first token of the decode window (context for the next delta)
        self._read = 0  # tokens whose text has been decoded
        self._pending = ""  # decoded, not yet emitted (could start a stop string)
        self._emitted: list[str] = []
        self.stopped_by: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def add(self, new_token_ids: Sequence[int], *, final: bool = False) -> str:
        """Append tokens; return the newly *safe* text (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(int(t) for t in new_token_ids)
        text = self._pending + self._decode_new(final)
        cut = -1
        for stop in self._stop:
            at = text.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut, self.stopped_by = at, stop
        if cut != -1:
            return self._emit(text[:cut], "")
        keep = 0 if final else self._held_back(text)
        return self._emit(text[: len(text) - keep], text[len(text) - keep :])

    def _decode_new(self, final: bool) -> str:
        """The text of the tokens not decoded yet ("" while it ends in a broken character)."""
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.token_ids)
        return after[len(before) :]

    def _held_back(self, text: str) -> int:
        keep = 0
        for stop in self._stop:  # a suffix that is a proper prefix of a stop string
            for k in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:k]):
                    keep = k
                    break
        return keep

    def _emit(self, delta: str, pending: str) -> str:
        self._pending = pending
        if delta:
            self._emitted.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._emitted)


# ------------------------------------------------------------------ logprobs as text
@dataclasses.dataclass(frozen=True, slots=True)
class Alternative:
    token: str
    logprob: float


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    offset: int
    top: list[Alternative] = dataclasses.field(default_factory=list)
    first: bool = False  # the prompt's first token: no logprob (nothing precedes it)


class LogprobsBuilder:
    """Turns one choice's outputs into :class:`TokenLogprob` rows (one builder per choice)."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text
        self.offset = 0
        self.rows: list[TokenLogprob] = []
        self.prompt_rows: list[TokenLogprob] = []
        self._prompt_sent = False

    def add(self, out: EngineCoreOutput) -> list[TokenLogprob]:
        """The rows of ``out``'s new tokens (also kept in :attr:`rows`); the prompt's rows, if
        ``out`` carries them, go to :attr:`prompt_rows` first."""
        if out.prompt_logprobs is not None and not self.prompt_rows:
            self.prompt_rows = self._rows(out.prompt_logprobs)
        lp = out.logprobs
        if lp is None:
            return []
        new = self._rows(lp)
        self.rows.extend(new)
        return new

    def _rows(self, lp: TokenLogprobs) -> list[TokenLogprob]:
        new: list[TokenLogprob] = []
        for ids, values in zip(lp.token_ids, lp.logprobs, strict=True):
            text = self.token_text(ids[0])
            if not values:  # the prompt's first token
                new.append(TokenLogprob(text, 0.0, self.offset, first=True))
            else:
                top = [
                    Alternative(self.token_text(t), v)
                    for t, v in zip(ids[1:], values[1:], strict=True)
                ]
                new.append(TokenLogprob(text, values[0], self.offset, top))
            self.offset += len(text)
        return new

    def delta(self, start: int, end: int) -> list[TokenLogprob]:
        """Generated rows ``[start, end)``, after the prompt's rows the first time they exist."""
        rows = self.rows[start:end]
        if self.prompt_rows and not self._prompt_sent:
            self._prompt_sent = True
            return [*self.prompt_rows, *rows]
        return rows

    def kept(self, num_tokens: int) -> list[TokenLogprob]:
        """The prompt's rows, then those of the first ``num_tokens`` generated tokens (what
        the answer keeps)."""
        return [*self.prompt_rows, *self.rows[:num_tokens]]


# ------------------------------------------------------------------ what api hands and gets
@dataclasses.dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One text generation as ``api`` asks for it: data only.

    ``params`` holds every choice's sampling parameters: ``n`` choices, P0's ``stop``
    strings, ``logprobs``. ``max_tokens`` is the client's output-token cap; ``None`` lets each
    choice use the context window its rendered prompt leaves (``params.max_tokens`` is
    replaced either way). ``lora_name`` / ``lora_id``: the LoRA adapter the request's
    ``model`` named (``client/lora.py``; None / 0: the base model), sent on every engine
    request of it."""

    request_id: str
    endpoint: str  # the route's short name: chat, completions, responses
    params: SamplingParams
    max_tokens: int | None = None
    lora_name: str | None = None
    lora_id: int = 0

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def reserve(self) -> int:
        """Output tokens the render must leave room for (1 without a cap)."""
        return 1 if self.max_tokens is None else self.max_tokens


class FinishedChoice(NamedTuple):
    """One choice of a whole answer: its text, finish reason and logprob rows (None: not asked)."""

    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """A whole answer: every choice, in order, and the tokens it used."""

    choices: list[FinishedChoice]
    usage: TokenUsage


@dataclasses.dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one output added to a choice: text (possibly empty), the finish reason once it
    finished, its logprob rows (None: not asked) and whether it is the choice's first delta."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    first: bool


def _note_usage(usage: TokenUsage) -> None:
    """Hand the request's token counts to its telemetry record (spans, token counters)."""
    record = current_record()
    if record is not None:
        record.usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


class OutputStream:
    """A started stream (every choice produced a first output): :meth:`deltas` once, then
    :attr:`usage`; :meth:`aclose` aborts what still runs (idempotent)."""

    def __init__(self, generation: Generation, request: GenerateRequest, processor: ModelProcessor):
        self._generation = generation
        self._request = request
        self._processor = processor
        self.usage = TokenUsage(0, 0, 0)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas in arrival order; a failure raises its typed error."""
        gen, params = self._generation, self._request.params
        detoks = [IncrementalDetokenizer(self._processor.decode, params.stop) for _ in range(gen.n)]
        builders = [LogprobsBuilder(self._processor.token_text) for _ in range(gen.n)]
        wants_logprobs = params.logprobs is not None
        started = [False] * gen.n
        cached = 0
        try:
            async for choice, out in gen.outputs():
                detok = detoks[choice]
                final = out.finish_reason is not None
                kept_before = len(detok.token_ids)
                text = detok.add(out.new_token_ids, final=final)
                cached = max(cached, out.num_cached_tokens)
                finish = out.finish_reason if final else None
                if detok.stopped:
                    finish = "stop"
                    await gen.finish_choice(choice)
                rows = None
                if wants_logprobs:  # the rows of the tokens this output added and the text keeps
                    builders[choice].add(out)
                    rows = builders[choice].delta(kept_before, len(detok.token_ids))
                if text or finish or rows or not started[choice]:
                    yield ChoiceDelta(choice, text, finish, rows, not started[choice])
                    started[choice] = True
        except RetryableFailure as failure:
            raise failure.error() from None
        finally:
            await gen.aclose()
        rendered = gen.rendered
        prompt = rendered.num_tokens if rendered is not None else 0
        self.usage = TokenUsage(prompt, sum(len(d.token_ids) for d in detoks), cached)
        _note_usage(self.usage)

    async def aclose(self) -> None:
        await self._generation.aclose()


class OutputProcessor:
    """Runs :class:`GenerateRequest` s through ``policy`` and decodes with ``processor``'s
    tokenizer; ``max_model_len`` bounds a choice without a token cap."""

    def __init__(self, policy: RecoveryPolicy, processor: ModelProcessor, max_model_len: int):
        self.policy = policy
        self.processor = processor
        self.max_model_len = max_model_len

    def engine_request(
        self, request: GenerateRequest, rid: str, rendered: RenderedPrompt, choice: int
    ) -> EngineCoreRequest:
        """The engine request of choice ``choice`` of ``request``, rendered as ``rendered``."""
        params = request.params
        room = max(self.max_model_len - rendered.num_tokens, 1)
        seed = None if params.seed is None else (params.seed + choice) % SEED_MODULUS
        cap = room if request.max_tokens is None else request.max_tokens
        return EngineCoreRequest(
            rid,
            rendered.token_ids,
            rendered.features[choice],
            sampling_params=msgspec.structs.replace(params, n=1, max_tokens=cap, seed=seed),
            arrival_time=time.time(),
            lora_name=request.lora_name,
            lora_id=request.lora_id,
        )

    def _build(self, request: GenerateRequest) -> Callable[..., EngineCoreRequest]:
        def build(rid: str, rendered: RenderedPrompt, choice: int) -> EngineCoreRequest:
            return self.engine_request(request, rid, rendered, choice)

        return build

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.processor.decode, params.stop)

    async def complete(self, source: SourcePrompt, request: GenerateRequest) -> Completion:
        """The whole answer; the recovery policy may retry a failure at any point."""
        params = request.params
        watched: list[IncrementalDetokenizer] = []  # the latest attempt's, per choice

        def watch() -> ChoiceWatch:  # per attempt: a stop string ends the choice in P1
            watched[:] = [self._detokenizer(params) for _ in range(request.n)]
            detoks = list(watched)

            def ends(choice: int, out: EngineCoreOutput) -> bool:
                detoks[choice].add(out.new_token_ids)
                return detoks[choice].stopped

            return ends

        rendered, outputs = await self.policy.complete(
            source,
            endpoint=request.endpoint,
            request_id=request.request_id,
            n=request.n,
            reserve=request.reserve,
            build=self._build(request),
            # without stop strings nothing can end a choice early: no watch, no decode
            watch=watch if any(params.stop) else None,
        )
        return self._finish(params, rendered, outputs, watched)

    def _finish(
        self,
        params: SamplingParams,
        rendered: RenderedPrompt,
        outputs: list[list[EngineCoreOutput]],
        watched: Sequence[IncrementalDetokenizer],
    ) -> Completion:
        """``watched``: the detokenizers that matched stop strings while the outputs arrived
        (empty without stop strings); each is finished, not redone, so a choice is decoded once
        and counts the tokens a stream of it would: up to the output that completed its stop
        string."""
        choices: list[FinishedChoice] = []
        completion = cached = 0
        for index, outs in enumerate(outputs):
            detok = watched[index] if watched else self._detokenizer(params)
            if not detok.stopped:  # what the watch has not seen: all, or the final output
                token_ids = [t for out in outs for t in out.new_token_ids]
                detok.add(token_ids[len(detok.token_ids) :], final=True)
            completion += len(detok.token_ids)
            cached = max([cached, *(out.num_cached_tokens for out in outs)])
            finish = "stop" if detok.stopped else (outs[-1].finish_reason if outs else None)
            rows = None
            if params.logprobs is not None:
                builder = LogprobsBuilder(self.processor.token_text)
                for out in outs:
                    builder.add(out)
                rows = builder.kept(len(detok.token_ids))
            choices.append(FinishedChoice(detok.text, finish, rows))
        usage = TokenUsage(rendered.num_tokens, completion, cached)
        _note_usage(usage)
        return Completion(choices, usage)

    async def stream(self, source: SourcePrompt, request: GenerateRequest) -> OutputStream:
        """A stream whose choices all produced a first output (a failure before that is
        retried or raised here, before any byte)."""
        generation = await self.policy.start(
            source,
            endpoint=request.endpoint,
            request_id=request.request_id,
            n=request.n,
            reserve=request.reserve,
            build=self._build(request),
        )
        return OutputStream(generation, request, self.processor)

    async def pool(
        self, source: SourcePrompt, *, endpoint: str, request_id: str, params: PoolingParams
    ) -> tuple[Any, int]:
        """One pooling request (embeddings): P1's pooled vector (None if it sent none) and the
        prompt's token count."""

        def build(rid: str, rendered: RenderedPrompt, choice: int) -> EngineCoreRequest:
            return EngineCoreRequest(
                rid,
                rendered.token_ids,
                rendered.features[choice],
                pooling_params=params,
                arrival_time=time.time(),
            )

        rendered, outputs = await self.policy.complete(
            source, endpoint=endpoint, request_id=request_id, n=1, reserve=0, build=build
        )
        pooled = next((o.pooled for o in reversed(outputs[0]) if o.pooled is not None), None)
        return pooled, rendered.num_tokens
