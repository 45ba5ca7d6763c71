"""``POST /v1/embeddings``: text, token ids or one multimodal input (text + images) -> pooled.

Invariants:
- Each input is one pooling request to P1 (``PoolingParams(pooling_type="mean",
  normalize=True)``), run through the same recovery policy as generation (endpoint
  ``embeddings``): a drifted image is retried once with its data, a second miss is a 503.
- A multimodal input (a list of content parts) is rendered as its parts in order, each image
  as the model's image token, joined by newlines; no chat template is applied.
- ``base64`` encodes the little-endian float32 bytes of the vector.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmis.frontend.api.schemas import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ImagePart,
)
from mmis.frontend.api.serving_common import new_request_id, unless_disconnected
from mmis.frontend.client.output_processor import OutputProcessor
from mmis.frontend.client.renderer import ImageRef, SourcePrompt
from mmis.frontend.client.tenancy import ANONYMOUS
from mmis.frontend.request_telemetry import current_record
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode, PoolingParams

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState


POOLING = PoolingParams(pooling_type="mean", normalize=True)


def _vector(pooled: Any) -> np.ndarray:
    if pooled is None:
        exc = MMISError("the engine returned no embedding")
        exc.code = ErrorCode.INTERNAL.value
        raise exc
    return np.asarray(pooled, dtype=np.float32).reshape(-1)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


class EmbeddingServing:
    def __init__(self, state: FrontendState) -> None:
        self.state = state
        self.outputs = OutputProcessor(state.policy, state.processor, state.max_model_len)

    async def _prepare(self, item: Any, tenant: str | None) -> SourcePrompt:
        renderer = self.state.renderer
        if isinstance(item, str):
            return await renderer.prepare(item, [], param="input")
        if item and all(isinstance(t, int) for t in item):
            return await renderer.prepare([int(t) for t in item], [], param="input")
        texts: list[str] = []
        images: list[ImageRef] = []
        for j, part in enumerate(item):
            if isinstance(part, ImagePart):
                texts.append(self.state.processor.image_token)
                images.append(ImageRef(part.url, part.item_uuid, f"input[{j}]", part.detail))
            else:
                texts.append(part.text)
        return await renderer.prepare("\n".join(texts), images, param="input", tenant=tenant)

    async def _embed(self, source: SourcePrompt, request_id: str) -> tuple[np.ndarray, int]:
        pooled, num_tokens = await self.outputs.pool(
            source, endpoint="embeddings", request_id=request_id, params=POOLING
        )
        return _vector(pooled), num_tokens

    async def _embed_all(
        self, sources: list[SourcePrompt], base: str
    ) -> list[tuple[np.ndarray, int]]:
        """All inputs concurrently; the first failure cancels (and aborts) the others."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._embed(s, f"{base}-{i}")) for i, s in enumerate(sources)
                ]
        except BaseExceptionGroup as errors:
            raise _first_leaf(errors) from None
        return [task.result() for task in tasks]

    async def create(
        self, http: Request, req: EmbeddingRequest, *, tenant: str | None = ANONYMOUS
    ) -> Response:
        items = req.items()
        sources = [await self._prepare(item, tenant) for item in items]
        base = new_request_id("embd")
        results = await unless_disconnected(http, self._embed_all(sources, base))
        data = []
        for i, (vector, _) in enumerate(results):
            if req.encoding_format == "base64":
                value: list[float] | str = base64.b64encode(vector.astype("<f4").tobytes()).decode()
            else:
                value = [float(x) for x in vector]
            data.append(EmbeddingData(index=i, embedding=value))
        tokens = sum(n for _, n in results)
        record = current_record()
        if record is not None:
            record.usage(tokens, 0)
        body = EmbeddingResponse(
            data=data,
            model=self.state.model_name,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return JSONResponse(body.model_dump(mode="json"))
