"""OpenAI-compatible request and response models of P0 (pydantic).

One module per endpoint (:mod:`.chat`, :mod:`.completions`, :mod:`.embeddings`), shared parts
in :mod:`.common` and :mod:`.sampling`, responses in :mod:`.responses`; :func:`parse_request`
turns a raw body into a model or a typed 400 naming the offending ``param``;
:func:`install_exception_handlers` makes a FastAPI app answer in the OpenAI error shape.
"""

from mmis.frontend.api.schemas.chat import ChatCompletionRequest, ChatMessage
from mmis.frontend.api.schemas.common import (
    ImageEmbedsPart,
    ImagePart,
    ImageURL,
    TextPart,
    VideoPart,
    VideoURL,
)
from mmis.frontend.api.schemas.completions import CompletionRequest
from mmis.frontend.api.schemas.embeddings import EmbeddingRequest
from mmis.frontend.api.schemas.responses import (
    AssistantMessage,
    BlockKeys,
    CacheStats,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    PrefixCacheReset,
    ProbeStatus,
    PromptTokensDetails,
    Usage,
    VersionInfo,
    sse_chunk,
)
from mmis.frontend.api.schemas.sampling import DEFAULT_MAX_N, StreamOptions
from mmis.frontend.api.schemas.validation import install_exception_handlers, parse_request

__all__ = [
    "DEFAULT_MAX_N",
    "AssistantMessage",
    "BlockKeys",
    "CacheStats",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatMessage",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "ErrorDetail",
    "ErrorResponse",
    "ImageEmbedsPart",
    "ImagePart",
    "ImageURL",
    "ModelCard",
    "ModelList",
    "PrefixCacheReset",
    "ProbeStatus",
    "PromptTokensDetails",
    "StreamOptions",
    "TextPart",
    "Usage",
    "VersionInfo",
    "VideoPart",
    "VideoURL",
    "install_exception_handlers",
    "parse_request",
    "sse_chunk",
]
