"""Sampling fields shared by ``/v1/chat/completions`` and ``/v1/completions``.

Ranges (each violation is a 400 naming the field): ``n`` in [1, max_n] (``max_n`` from the
validation context, default :data:`DEFAULT_MAX_N`), ``temperature`` in [0, 2], ``top_p`` in
(0, 1], ``top_k`` >= 0 (extension; 0 = off), ``max_tokens`` >= 1, ``seed`` in [0, 2**63),
``stop`` a string or up to :data:`MAX_STOP` non-empty strings, ``stream_options`` only with
``stream: true``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from mmis.frontend.schemas.common import OpenAIModel
from mmis.protocol.messages import SamplingParams

DEFAULT_MAX_N = 16
MAX_STOP = 16


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False  # extension (as in vLLM): decode to max_tokens past end-of-sequence

    @field_validator("n")
    @classmethod
    def _n_at_most_max(cls, value: int, info: ValidationInfo) -> int:
        context = info.context if isinstance(info.context, dict) else {}
        limit = int(context.get("max_n", DEFAULT_MAX_N))
        if value > limit:
            raise ValueError(f"must be at most {limit} (the server's max_n)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(not item for item in items):
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The client's output-token cap (``None``: up to the context window)."""
        return self.max_tokens

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The wire sampling parameters; ``default_max_tokens`` applies when none was asked."""
        requested = self.requested_max_tokens()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            max_tokens=default_max_tokens if requested is None else requested,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
        )


def context_for(max_n: int) -> dict[str, Any]:
    """The pydantic validation context carrying the server's limits."""
    return {"max_n": max_n}
