"""``POST /v1/completions``: a text (or token-id) prompt -> generation, whole or streamed.

Invariant: the prompt is used as given (no chat template, no special tokens added); a prompt
that contains the model's image token is a 400 (this endpoint carries no images). With
``echo: true`` every choice's text starts with the prompt (a token-id prompt decoded): the
whole answer's ``text`` and a stream's first chunk of each choice. With ``logprobs`` too
(``SamplingParams.prompt_logprobs``), the choice's ``logprobs`` starts with the prompt
tokens' rows, the first one ``null`` (``frontend/api/logprobs.py``): the whole answer's and a
stream's first chunk of each choice; every choice of ``n`` carries the same prompt rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from mmis.frontend.api import logprobs
from mmis.frontend.api.logprobs import TokenLogprob
from mmis.frontend.api.schemas import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from mmis.frontend.api.serving_common import new_request_id
from mmis.frontend.api.serving_generate import Choice, ChunkStream, TextGenerator

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState


class CompletionFormat(ChunkStream):
    def __init__(self, model: str, echo: str = "") -> None:
        self.model = model
        self.echo = echo  # the prompt text each choice starts with (echo: true)

    def whole(self, request_id: str, choices: Sequence[Choice], usage: Usage) -> CompletionResponse:
        return CompletionResponse(
            id=request_id,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=self.echo + text,
                    finish_reason=finish,  # type: ignore[arg-type]
                    logprobs=None if rows is None else logprobs.completion(rows),
                )
                for i, (text, finish, rows) in enumerate(choices)
            ],
            usage=usage,
        )

    def chunk(
        self,
        request_id: str,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool,
        rows: list[TokenLogprob] | None = None,
    ) -> CompletionResponse:
        choice = CompletionChoice(
            index=index,
            text=(self.echo if first else "") + (text or ""),
            finish_reason=finish,  # type: ignore[arg-type]
            logprobs=None if rows is None else logprobs.completion(rows),
        )
        return CompletionResponse(id=request_id, model=self.model, choices=[choice])

    def usage_chunk(self, request_id: str, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=self.model, choices=[], usage=usage)


class CompletionServing:
    def __init__(self, state: FrontendState) -> None:
        self.state = state
        self.generator = TextGenerator(state, "completions")
        self.format = CompletionFormat(state.model_name)

    async def create(self, http: Request, req: CompletionRequest) -> Response:
        source = await self.state.renderer.prepare(req.prompt, [], param="prompt")
        fmt = self.format
        model = self.generator.model_name(req)  # a LoRA adapter's name when it names one
        if req.echo:
            prompt = req.prompt
            text = prompt if isinstance(prompt, str) else self.state.processor.decode(prompt)
            fmt = CompletionFormat(model, echo=text)
        elif model != self.state.model_name:
            fmt = CompletionFormat(model)
        return await self.generator.respond(http, req, source, fmt, new_request_id("cmpl"))
