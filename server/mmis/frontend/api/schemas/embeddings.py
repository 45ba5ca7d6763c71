"""``POST /v1/embeddings`` request model, with a documented multimodal extension.

``input`` is one of:
- a non-empty string: one embedding;
- a list of non-empty strings (at most :data:`MAX_BATCH`): one embedding per string;
- a non-empty list of token ids: one embedding;
- **extension** — a list of content parts, the same parts as chat messages::

      "input": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                {"type": "text", "text": "a red square"}]

  These parts together form *one* multimodal input and give one embedding (an image alone is
  a one-part list). ``uuid`` / hash-only parts behave as in chat.

``encoding_format`` is ``float`` (default) or ``base64``; ``dimensions`` is not supported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from mmis.frontend.api.schemas.common import (
    TOKEN_ID_LIMIT,
    ContentPart,
    ImagePart,
    OpenAIModel,
    TextPart,
    add_unsupported_to_schema,
    reject_unsupported,
)

MAX_BATCH = 2048

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT, strict=True)]


def _input_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "[text]"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "list[text]"
        if isinstance(first, int) and not isinstance(first, bool):
            return "list[token]"
        if isinstance(first, dict | TextPart | ImagePart):
            return "list[part]"
    return None


EmbeddingInput = Annotated[
    Annotated[NonEmptyText, Tag("[text]")]
    | Annotated[list[NonEmptyText], Tag("list[text]"), Field(min_length=1, max_length=MAX_BATCH)]
    | Annotated[list[TokenId], Tag("list[token]"), Field(min_length=1)]
    | Annotated[list[ContentPart], Tag("list[part]"), Field(min_length=1)],
    Discriminator(
        _input_tag,
        custom_error_type="invalid_input",
        custom_error_message=(
            "must be a non-empty string, a list of strings, a list of token ids, or a "
            "list of content parts ({'type': 'text' | 'image_url', ...}) forming one input"
        ),
    ),
]

EmbeddingItem = str | list[int] | list[TextPart | ImagePart]


_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"dimensions": ()}


def _request_schema(schema: dict[str, Any], model: type[Any]) -> None:
    add_unsupported_to_schema(schema, model, _UNSUPPORTED)


class EmbeddingRequest(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=_request_schema)

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = Field(default=None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return reject_unsupported(cls, data, _UNSUPPORTED)

    @property
    def is_multimodal(self) -> bool:
        return _input_tag(self.input) == "list[part]"

    def items(self) -> list[EmbeddingItem]:
        """One entry per embedding to compute, in response order."""
        tag = _input_tag(self.input)
        if tag == "list[text]":
            return list(self.input)  # type: ignore[arg-type]
        return [self.input]  # type: ignore[list-item]

    def image_parts(self) -> Iterator[tuple[str, ImagePart]]:
        if self.is_multimodal:
            for j, part in enumerate(self.input):
                if isinstance(part, ImagePart):
                    yield f"input[{j}]", part
