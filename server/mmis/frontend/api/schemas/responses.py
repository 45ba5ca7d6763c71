"""OpenAI response shapes: chat and text completions (whole and streamed), embeddings, usage,
the model list. ``created`` is a Unix time in seconds.

Streams are Server-Sent Events: each chunk is ``data: <json>\\n\\n`` (:func:`sse_chunk`), the
stream ends with ``data: [DONE]``. With ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk has ``"choices": []`` and the usage. Chat answers to a
request with tools may carry ``tool_calls`` (finish reason ``tool_calls``; shapes in
:mod:`.tools`).

Errors are :class:`ErrorResponse` (the shape :func:`mmis.frontend.errors.error_body` writes);
the probes answer :class:`ProbeStatus`, ``GET /stats/cache`` :class:`CacheStats`,
``GET /version`` :class:`VersionInfo`. These models are the response schemas of
``GET /openapi.json`` (:mod:`mmis.frontend.api.openapi`); ``tests/e2e/test_fuzz_openapi.py``
checks the server's real answers against them.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mmis.frontend.api.schemas.tools import ToolCall, ToolCallDelta

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


def _now() -> int:
    return int(time.time())


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # chat with tools (mmis.frontend.api.tool_calls); left out when there are none, as OpenAI does
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[].logprobs`` of chat (``logprobs: true``): one entry per generated token."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """``choices[].logprobs`` of completions (``logprobs: k``), the legacy column layout."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (OpenAI uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "mmis"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's ModelCard)
    max_model_len: int | None = None
    # what the engine computes in (``--dtype`` resolved: on CPU ``auto`` may serve a float32
    # checkpoint in bfloat16) and on which device type
    dtype: str | None = None
    device: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse_chunk(chunk: BaseModel) -> bytes:
    """One Server-Sent Event carrying ``chunk`` as JSON."""
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


class ErrorDetail(BaseModel):
    """The ``error`` object; the documented extra keys of :mod:`mmis.frontend.errors` are
    optional fields, and other keys are allowed."""

    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None
    code: str | None
    retryable: bool | None = Field(
        default=None, description="true: resending can succeed (422: with the image data)"
    )
    missing_uuids: list[str] | None = Field(
        default=None, description="422 multimodal_cache_miss: the uuids to resend with data"
    )
    missing_mm_hashes: list[str] | None = Field(
        default=None, description="503 multimodal_cache_miss: the items missed twice"
    )


class ErrorResponse(BaseModel):
    """Every error in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class ProbeStatus(BaseModel):
    """``GET /health`` and ``GET /ready``: 200 when up / ready, else 503 with the reason."""

    status: str


class BlockKeys(BaseModel):
    """``POST /internal/block_keys``: a chat request's prefix-cache block keys
    (``protocol/block_keys.py``), as P1 will announce them in its KV events."""

    block_size: int = Field(ge=1, description="tokens per block (the engine's)")
    prompt_tokens: int = Field(ge=0, description="the prompt's tokens, images expanded")
    block_keys: list[str] = Field(description="hex keys of the prompt's full blocks, in order")
    mm_hashes: list[str] = Field(description="the request's multimodal items, in order")


class PrefixCacheReset(BaseModel):
    """``POST /internal/reset_prefix_cache``: how many cached prefix blocks P1 forgot."""

    blocks: int = Field(ge=0, description="blocks forgotten (announced as AllBlocksCleared)")


class LoRAAdapterStat(BaseModel):
    name: str = Field(description="the adapter's name (a request's `model`)")
    path: str = Field(description="what it was loaded from: a directory or an hf:// hub id")


class LoRAStats(BaseModel):
    """``/stats/cache``'s ``lora``: the adapters the engine holds (the operator's sync)."""

    adapters: list[LoRAAdapterStat] = Field(description="sorted by name")
    max_loras: int = Field(ge=0, description="the engine's --max-loras")


class CacheStats(BaseModel):
    """``GET /stats/cache``: the drift window (:meth:`mmis.telemetry.drift.DriftWindow.stats`)
    and, with LoRA on, the engine's adapters (``lora``; absent without LoRA)."""

    drift_rate: float = Field(ge=0.0, description="drift misses / shadow hits; 0 without hits")
    hit_rate: float = Field(ge=0.0, le=1.0, description="sender-cache hits / lookups")
    retry_rate: float = Field(ge=0.0, description="retries / requests")
    window_seconds: float = Field(gt=0.0, description="the configured window")
    span_seconds: float = Field(ge=0.0, description="how much of the window the samples cover")
    shadow_hits: float = Field(ge=0.0)
    drift_misses: float = Field(ge=0.0)
    queries: float = Field(ge=0.0)
    retries: float = Field(ge=0.0)
    requests: float = Field(ge=0.0)
    lora: LoRAStats | None = Field(
        default=None, description="with LoRA on: the engine's adapters; absent without"
    )


class VersionInfo(BaseModel):
    """``GET /version``: the version of the ``mmis`` package serving."""

    version: str
