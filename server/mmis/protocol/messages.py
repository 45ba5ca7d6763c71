"""Typed messages exchanged between P0 (front end) and P1 (engine core).

Invariants:
- Every struct is ``array_like``: encoded as a positional msgpack array, never a map.
- Fields are only ever *appended at the end*, each new one with a default, so an older
  decoder reads a newer message (extra trailing items are ignored) and a newer decoder reads
  an older one (missing trailing items take their defaults). Golden byte fixtures under
  ``tests/protocol/golden`` pin every released version; inserting a field anywhere else
  breaks them.
- Nothing here imports the rest of mmis; nothing on the wire is pickled.
- Tensor payloads (``MultiModalFeature.data`` values) are numpy arrays in memory; the codec
  moves them as separate zero-copy frames above a small size threshold.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class RequestType(bytes, enum.Enum):
    """The 1-byte first frame of every P0 -> P1 message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorCode(enum.StrEnum):
    """Codes carried by :class:`RequestError`; the front end maps them to HTTP statuses."""

    MULTIMODAL_CACHE_MISS = "multimodal_cache_miss"
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INTERNAL = "internal_error"
    ENGINE_RESTARTED = "engine_restarted"
    """P1 restarted (new cache epoch) under a request in flight; retryable."""
    ENGINE_UNAVAILABLE = "engine_unavailable"
    """P1 stopped answering (or P0 is closing); retryable by the client."""
    UTILITY_FAILED = "utility_failed"
    """A utility call raised an error that has no code of its own."""
    UNKNOWN_UTILITY = "unknown_utility"
    """A utility call names a method this engine does not have (e.g. LoRA without
    ``--enable-lora``)."""
    # LoRA refusals (engine/lora/errors.py); P0 switches on these, never on message texts
    LORA_INVALID = "lora_invalid"
    """An adapter that cannot be loaded: files, PEFT config, rank or target modules."""
    LORA_ALREADY_LOADED = "lora_already_loaded"
    LORA_ID_REUSED = "lora_id_reused"
    """A load under an id that is not positive or was used before in the engine's life."""
    LORA_NOT_LOADED = "lora_not_loaded"
    """A request or an unload names an adapter the engine does not hold."""
    LORA_ID_MISMATCH = "lora_id_mismatch"
    """A request names a held adapter under another id (a stale P0 entry)."""
    LORA_IN_USE = "lora_in_use"
    """An unload refused while a live request runs under the adapter."""


class PlaceholderRange(msgspec.Struct, array_like=True, frozen=True):
    """Where an item's placeholder tokens sit in the prompt."""

    offset: int
    length: int


class ShmAddress(msgspec.Struct, array_like=True, frozen=True, tag="shm", tag_field="kind"):
    """An address descriptor into the shared-memory object store.

    ``signature`` authenticates (segment, offset, length, handle_id, generation) with the
    store's per-segment key, so a forged or stale descriptor is rejected by the reader.
    The reader must acknowledge every descriptor it receives (handle_id) so the writer can
    reclaim the space.
    """

    segment: str
    offset: int
    length: int
    handle_id: int
    generation: int
    signature: bytes


class MultiModalFeature(msgspec.Struct, array_like=True, kw_only=True):
    """One multimodal item of a request, named by one hash.

    ``mm_hash`` is the item's only name: P1's receiver cache, encoder cache and prefix-cache
    block keys (``protocol/block_keys.py``) all key on it.

    ``data`` is one of:
    - a mapping of tensor name -> numpy array (the processor output for this item; P1 puts
      the resolved tensors here before admission, ``engine/core_process.py``);
    - ``None``: P0's shadow says P1 still holds the item (P1 must resolve it by ``mm_hash``);
    - a :class:`ShmAddress`: the tensors live in the shared-memory object store.

    ``_identifier`` is a retired slot (protocol v6, see ``protocol/schema.py``): v1-v5 sent
    a second copy of ``mm_hash`` there. It keeps its position so every version decodes;
    v6 writes it empty and nothing reads it. P0 and P1 of one pod run the same image
    (``operator/mmis_operator/builders.py``), so no v5 engine keys blocks by the empty slot.
    Keyword construction only (``kw_only``), so the slot never has to be passed.
    """

    modality: str
    mm_hash: str
    _identifier: str = ""
    placeholder: PlaceholderRange
    data: dict[str, Any] | ShmAddress | None = None


class StructuredOutputs(msgspec.Struct, array_like=True):
    """A constraint on a request's output text, enforced token by token in P1.

    ``kind`` names what ``spec`` holds (P1 compiles it once per distinct pair and caches it,
    ``engine/execution/structured.py``; P0 builds it, ``frontend/api/structured_outputs.py``):

    - ``"json"``: ``spec`` is a JSON Schema, as JSON text; the output is one JSON value that
      validates against it;
    - ``"json_object"``: any JSON object (``spec`` is ignored);
    - ``"regex"``: ``spec`` is a regular expression the whole output must match;
    - ``"choice"``: ``spec`` is a JSON array of strings; the output is exactly one of them;
    - ``"grammar"``: ``spec`` is an EBNF (GBNF) grammar whose ``root`` rule the output matches.

    ``param`` is the request parameter that carried the constraint (``response_format``,
    ``structured_outputs``, ``tool_choice``, ...): a spec that does not compile is the
    request's error (``invalid_request``) with ``RequestError.param`` set to it, which P0
    answers as a 400 naming it. Generation ends (``stop``) when the constraint is complete:
    only end-of-sequence tokens are allowed then.
    """

    kind: str
    spec: str = ""
    param: str = ""


class SamplingParams(msgspec.Struct, array_like=True):
    """How to pick each output token (P1 checks the ranges:
    ``engine/scheduling/sampling_params.py`` ``validate``).

    ``presence_penalty`` / ``frequency_penalty`` (OpenAI, [-2, 2], 0 off) count the tokens
    generated so far; ``repetition_penalty`` (> 0, 1 off) covers prompt and output;
    ``min_p`` ([0, 1], 0 off); ``logit_bias`` maps token id -> bias in [-100, 100].
    ``logprobs``: ``None`` off; else each sampled token's log-probability and that many of
    the most likely alternatives ([0, 20]) come back in ``EngineCoreOutput.logprobs``.
    ``structured``: ``None`` unconstrained; else the :class:`StructuredOutputs` the output
    must follow (P1 masks every token the constraint does not allow before sampling).
    ``prompt_logprobs``: ``None`` off; else every prompt token's log-probability given the
    tokens before it, with that many alternatives ([0, 20]), in the request's first output
    (``EngineCoreOutput.prompt_logprobs``); such a request bypasses the prefix cache.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    logprobs: int | None = None
    structured: StructuredOutputs | None = None
    prompt_logprobs: int | None = None


class PoolingParams(msgspec.Struct, array_like=True):
    pooling_type: str = "mean"  # "mean" | "last"
    normalize: bool = True


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature] = msgspec.field(default_factory=list)
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    arrival_time: float = 0.0
    trace_context: dict[str, str] = msgspec.field(default_factory=dict)
    skip_cache: bool = False
    client_index: int = 0
    # the LoRA adapter the request runs under (issue 47; None / 0: the base model). The name
    # selects it in P1; the id is the int vLLM's KV events carry as ``lora_id``. Appended with
    # defaults, so a message without them decodes as a base request.
    lora_name: str | None = None
    lora_id: int = 0


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]
    client_index: int = 0


class RequestError(msgspec.Struct, array_like=True):
    """A structured, typed error. ``retryable`` tells the client whether resending helps;
    ``param``, when set, names the request parameter at fault (P0's 400 names it)."""

    code: str
    message: str
    retryable: bool = False
    param: str | None = None


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)
    client_index: int = 0


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    ok: bool
    result: Any = None
    error: RequestError | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities of the new tokens of one output, one row per token.

    Row ``i``: ``token_ids[i][0]`` is the sampled token, the rest its most likely
    alternatives in decreasing order; ``logprobs[i][j]`` belongs to ``token_ids[i][j]``;
    ``ranks[i]`` is the sampled token's rank (1 = the most likely). Computed in P1 from the
    model's logits of that step, before any sampling parameter (``engine/execution/logprobs.py``).
    As prompt logprobs (``EngineCoreOutput.prompt_logprobs``) there is one row per prompt
    token, ``token_ids[i][0]`` being prompt token ``i``; row 0 has no value (nothing comes
    before it): ``token_ids[0] == [first prompt token]``, ``logprobs[0] == []``, rank 0.
    """

    token_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: list[list[float]] = msgspec.field(default_factory=list)
    ranks: list[int] = msgspec.field(default_factory=list)


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """Progress of one request since the previous output.

    ``index`` is reserved (always 0): P1 serves one choice per request and P0 fans ``n`` out
    into requests of its own; the field stays so that the wire format keeps its positions.
    """

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    error: RequestError | None = None
    missing_mm_hashes: list[str] = msgspec.field(default_factory=list)
    index: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    pooled: Any = None  # a numpy array for pooling requests
    stop_reason: str | int | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    prompt_logprobs: TokenLogprobs | None = None  # in the first output, when asked for


class CachedItem(msgspec.Struct, array_like=True, frozen=True):
    """An item P1's receiver cache stored, as another P0's shadow needs it (protocol v7).

    ``nbytes`` is what both sides charge it (``multimodal/cache.py`` ``item_nbytes``);
    ``placeholder_length`` is the number of placeholder tokens its prompt expanded to (the
    length of the storing request's ``PlaceholderRange``), fixed by ``mm_hash``.
    """

    mm_hash: str
    nbytes: int
    placeholder_length: int


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One batch of outputs from P1 to one client (P0).

    Besides the outputs it carries what that client has not heard yet of P1's receiver cache
    (``engine/output_channel.py``; the invariant is in ``multimodal/cache.py``), to be applied
    in this order: ``shadow_reset`` (forget the whole shadow: P1 lost track of what this
    client heard), then ``evicted_mm_hashes``, then ``stored_mm_items`` (items other clients'
    requests stored, oldest first). A hash appears in at most one of the two lists.
    """

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    engine_index: int = 0
    timestamp: float = 0.0
    cache_epoch: str = ""
    evicted_mm_hashes: list[str] = msgspec.field(default_factory=list)
    utility_result: UtilityResult | None = None
    stored_mm_items: list[CachedItem] = msgspec.field(default_factory=list)
    shadow_reset: bool = False
