"""Transformers references computed on a worker thread while the engine process starts.

An engine process spends most of its start importing torch and transformers on one core; the
``generate()`` references a module needs can run meanwhile on another.

Invariants:
- ``refs(text, images, max_tokens)`` is exactly ``ModelKit.reference(text, images,
  max_tokens)``: a listed spec is computed ahead, any other on demand, same tokens either way.
- Every use of the kit's model goes through one worker thread, so the reference model is never
  run from two threads at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from engine_inputs import ModelKit
from PIL import Image

Spec = tuple[str, Sequence[Image.Image], int]  # text, images, max_tokens
_Key = tuple[str, tuple[bytes, ...], int]


def _key(text: str, images: Sequence[Image.Image], max_tokens: int) -> _Key:
    return text, tuple(im.tobytes() for im in images), max_tokens


class References:
    """``ModelKit.reference`` with the listed specs started ahead on one worker thread."""

    def __init__(self, kit: ModelKit, ahead: Iterable[Spec]) -> None:
        self.kit = kit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
        self._futures: dict[_Key, Future[list[int]]] = {}
        for text, images, max_tokens in ahead:
            self._submit(text, images, max_tokens)

    def _submit(
        self, text: str, images: Sequence[Image.Image], max_tokens: int
    ) -> Future[list[int]]:
        key = _key(text, images, max_tokens)
        if key not in self._futures:
            self._futures[key] = self._pool.submit(
                self.kit.reference, text, list(images), max_tokens
            )
        return self._futures[key]

    def __call__(self, text: str, images: Sequence[Image.Image], max_tokens: int) -> list[int]:
        return self._submit(text, images, max_tokens).result()

    def embedding(self, text: str, images: Sequence[Image.Image]) -> np.ndarray:
        """``ModelKit.reference_embedding``, on the same worker thread."""
        return self._pool.submit(self.kit.reference_embedding, text, list(images)).result()

    def __enter__(self) -> References:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
