"""Shared pieces of the OpenAI request models: base config, sampling fields, content parts.

What we accept (documented contract):
- Values must have the JSON type their field states (strict validation: ``"0.5"`` is not a
  number, ``true`` is not an integer).
- Unknown top-level fields are ignored (clients send many), *except* known OpenAI features we
  do not implement (``functions``, ``audio``, ``suffix``, ``best_of`` > 1, ...; each request
  module lists its own): sending one with a non-default value is a 400 naming it, never
  silently ignored.
- ``image_url.detail``: ``low`` renders the image at the processor's minimum pixel budget
  (:mod:`mmis.frontend.client.processor`); ``auto``/``high`` use its own limits.
- Content parts: ``{"type": "text", "text": ...}`` and ``{"type": "image_url", ...}``, where an
  image part is one of
  ``{"image_url": {"url": URL}}``, ``{"image_url": {"url": URL, "uuid": ID}}`` (data plus a
  client-chosen id that later requests may use alone), ``{"image_url": {"uuid": ID}}`` or
  ``{"uuid": ID}`` (id only: the server must still hold the item, else the documented 422 of
  :mod:`mmis.frontend.errors`), and ``{"image_url": URL}`` (a bare string).
  ``uuid`` may appear in both places only if equal.
- Chat content may also hold ``{"type": "video_url", "video_url": {"url": URL}}`` parts (or
  ``"video_url": URL``), with an optional ``uuid`` (``video_url.uuid`` or ``uuid``) that names
  the item in the caches instead of its content hash; a video part always carries its URL (no
  hash-only videos). Other inputs (embeddings) take text and image parts only.
- The JSON schemas of these models (``model_json_schema()``, what ``GET /openapi.json`` serves,
  :mod:`mmis.frontend.api.openapi`) state the same rules as the validators where JSON Schema can:
  an image part names a url or a uuid, a bare-string ``image_url``, and every unsupported
  parameter with the only values accepted for it (:func:`unsupported_schema`).
- Union-typed fields use callable discriminators whose tags contain brackets (``list[part]``):
  only the matching branch validates, and :mod:`~mmis.frontend.errors` drops such tags
  from the error location, so ``param`` reads like ``messages[0].content[1].image_url.url``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

UUID_MAX_LENGTH = 256
# No vocabulary is this large; the engine checks the model's own (a 400 naming the range).
# Without a bound, ids past 64 bits reached the wire encoder (a 500).
TOKEN_ID_LIMIT = 2**31


class OpenAIModel(BaseModel):
    # strict: a value is taken only as the JSON type its schema states (no "1" for 1, no
    # true for 1.0), so the documented schema is exactly what is accepted
    model_config = ConfigDict(extra="ignore", strict=True)


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON (and JSON Schema's ``const``) sees it: ``true`` is not ``1``, ``1.0``
    is ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(json_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _is_default(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``null``, ``false``, ``0``, ``[]``, ``{}`` or an allowed value (as :func:`unsupported_schema`
    states it)."""
    return any(json_equal(value, default) for default in (None, False, 0, [], {}, *allowed))


def reject_unsupported(
    model: type[BaseModel], data: Any, unsupported: dict[str, tuple[Any, ...]]
) -> Any:
    """Raise if ``data`` sets an unsupported OpenAI parameter to a non-default value.

    The error's location is the parameter itself, so the 400 names it in ``param``. A name
    that ``model`` declares as a field is supported (the field validates it), not rejected.
    """
    if not isinstance(data, dict):
        return data
    unsupported = still_unsupported(model, unsupported)
    errors = [
        InitErrorDetails(
            type=PydanticCustomError("unsupported_parameter", "is not supported by this server"),
            loc=(name,),
            input=data[name],
        )
        for name, allowed in unsupported.items()
        if name in data and not _is_default(data[name], allowed)
    ]
    if errors:
        raise ValidationError.from_exception_data(model.__name__, errors)
    return data


def still_unsupported(
    model: type[BaseModel], unsupported: dict[str, tuple[Any, ...]]
) -> dict[str, tuple[Any, ...]]:
    """``unsupported`` less the names ``model`` declares as fields."""
    fields = model.model_fields
    return {name: allowed for name, allowed in unsupported.items() if name not in fields}


def unsupported_schema(allowed: tuple[Any, ...]) -> dict[str, Any]:
    """The JSON schema of an unsupported parameter: only its default-like values pass."""
    branches: list[dict[str, Any]] = [
        {"type": "null"},
        {"const": False},
        {"const": 0},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
        *({"const": value} for value in allowed),
    ]
    return {
        "anyOf": branches,
        "description": "not supported by this server: any other value is a 400 naming it",
    }


def add_unsupported_to_schema(
    schema: dict[str, Any], model: type[BaseModel], unsupported: dict[str, tuple[Any, ...]]
) -> None:
    """Document each still-unsupported parameter of ``model`` in its JSON ``schema``."""
    properties = schema.setdefault("properties", {})
    for name, allowed in still_unsupported(model, unsupported).items():
        properties[name] = unsupported_schema(allowed)


def add_sampling_rules(schema: dict[str, Any], max_stop: int) -> None:
    """The rules of :class:`~mmis.frontend.api.schemas.sampling.SamplingRequest`'s validators that
    its field types do not carry: non-empty stop strings (at most ``max_stop``), and
    ``stream_options`` only with ``stream: true``."""
    properties = schema["properties"]
    properties["stop"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": max_stop},
            {"type": "null"},
        ],
        "default": None,
        "title": "Stop",
    }
    schema["dependentSchemas"] = {
        "stream_options": {
            "anyOf": [
                {"properties": {"stream_options": {"type": "null"}}},
                {"properties": {"stream": {"const": True}}, "required": ["stream"]},
            ]
        }
    }


def _image_url_schema(schema: dict[str, Any]) -> None:
    schema["anyOf"] = [
        {"required": ["url"], "properties": {"url": {"type": "string"}}},
        {"required": ["uuid"], "properties": {"uuid": {"type": "string"}}},
    ]


def _image_part_schema(schema: dict[str, Any]) -> None:
    # the bare-string form ``"image_url": URL`` (see ``ImagePart._bare_url``)
    schema["properties"]["image_url"]["anyOf"].insert(1, {"type": "string", "minLength": 1})
    schema["anyOf"] = [
        {"required": ["image_url"], "properties": {"image_url": {"type": ["object", "string"]}}},
        {"required": ["uuid"], "properties": {"uuid": {"type": "string"}}},
    ]


class ImageURL(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=_image_url_schema)

    url: str | None = Field(default=None, min_length=1)
    uuid: str | None = Field(default=None, min_length=1, max_length=UUID_MAX_LENGTH)
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImagePart(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=_image_part_schema)

    type: Literal["image_url"]
    image_url: ImageURL | None = None
    uuid: str | None = Field(default=None, min_length=1, max_length=UUID_MAX_LENGTH)

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("image_url"), str):
            return {**data, "image_url": {"url": data["image_url"]}}
        return data

    @model_validator(mode="after")
    def _names_an_image(self) -> ImagePart:
        inner = self.image_url
        if inner is None and self.uuid is None:
            raise ValueError("an image_url part needs image_url.url, image_url.uuid or uuid")
        if inner is not None and inner.url is None and inner.uuid is None:
            raise ValueError("image_url needs a url or a uuid")
        if inner is not None and inner.uuid and self.uuid and inner.uuid != self.uuid:
            raise ValueError("uuid and image_url.uuid differ; give one")
        return self

    @property
    def url(self) -> str | None:
        return self.image_url.url if self.image_url is not None else None

    @property
    def item_uuid(self) -> str | None:
        if self.image_url is not None and self.image_url.uuid is not None:
            return self.image_url.uuid
        return self.uuid

    @property
    def detail(self) -> str | None:
        return self.image_url.detail if self.image_url is not None else None

    @property
    def hash_only(self) -> bool:
        """True when the part names an earlier item by uuid and carries no data."""
        return self.url is None


class VideoURL(OpenAIModel):
    url: str = Field(min_length=1)
    uuid: str | None = Field(default=None, min_length=1, max_length=UUID_MAX_LENGTH)


class VideoPart(OpenAIModel):
    type: Literal["video_url"]
    video_url: VideoURL
    uuid: str | None = Field(default=None, min_length=1, max_length=UUID_MAX_LENGTH)

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("video_url"), str):
            return {**data, "video_url": {"url": data["video_url"]}}
        return data

    @model_validator(mode="after")
    def _one_uuid(self) -> VideoPart:
        if self.video_url.uuid and self.uuid and self.video_url.uuid != self.uuid:
            raise ValueError("uuid and video_url.uuid differ; give one")
        return self

    @property
    def url(self) -> str:
        return self.video_url.url

    @property
    def item_uuid(self) -> str | None:
        return self.video_url.uuid or self.uuid


class ImageEmbedsPart(OpenAIModel):
    """Precomputed image embeddings (``--enable-mm-embeds``): base64 of a .npy
    ``[tokens, hidden]`` float array, and Qwen2-VL's ``image_grid_thw``. The server checks
    the array (``frontend/client/mm_embeds.py`` ``decode_embeds``); without the flag a 400."""

    type: Literal["image_embeds"]
    image_embeds: str = Field(min_length=1)
    image_grid_thw: list[int] | None = Field(default=None, min_length=3, max_length=3)


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):  # any JSON value may come here: {} is unhashable
        return None
    return {"text": "part[text]", "image_url": "part[image_url]"}.get(kind)


def _chat_part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if isinstance(kind, str) and kind == "video_url":
        return "part[video_url]"
    if isinstance(kind, str) and kind == "image_embeds":
        return "part[image_embeds]"
    return _part_tag(value)


ContentPart = Annotated[
    Annotated[TextPart, Tag("part[text]")] | Annotated[ImagePart, Tag("part[image_url]")],
    Discriminator(
        _part_tag,
        custom_error_type="invalid_content_part",
        custom_error_message="part type must be 'text' or 'image_url'",
    ),
]


def _content_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "[str]"
    if isinstance(value, list):
        return "list[part]"
    return None


ChatContentPart = Annotated[
    Annotated[TextPart, Tag("part[text]")]
    | Annotated[ImagePart, Tag("part[image_url]")]
    | Annotated[VideoPart, Tag("part[video_url]")]
    | Annotated[ImageEmbedsPart, Tag("part[image_embeds]")],
    Discriminator(
        _chat_part_tag,
        custom_error_type="invalid_content_part",
        custom_error_message=(
            "part type must be 'text' or 'image_url' or 'video_url' or 'image_embeds'"
        ),
    ),
]

Content = Annotated[
    Annotated[str, Tag("[str]")] | Annotated[list[ChatContentPart], Tag("list[part]")],
    Discriminator(
        _content_tag,
        custom_error_type="invalid_content",
        custom_error_message="must be a string or a list of content parts",
    ),
]
