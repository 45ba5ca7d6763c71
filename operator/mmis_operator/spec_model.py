"""``spec.model``: which model is served, where its files are cached, how it is downloaded.

Invariants:
- Exactly one of ``id`` (a Hugging Face model id, downloaded into the cache) or ``path`` (an
  absolute directory inside the pod, never downloaded) is set; ``name`` is whichever it is,
  and the served name defaults to it.
- ``tokenSecretRef`` (``HF_TOKEN`` of the download) names a Secret and only goes with ``id``.
- The cache is an emptyDir or a PersistentVolumeClaim: an existing one (``claimName``,
  neither created nor deleted by the operator) or one the operator creates (optionally of
  ``storageClassName``), never both; its size is positive whole bytes.
- Defaults come from ``spec_fields.DEFAULTS``; a violation raises
  :class:`~mmis_operator.spec_errors.InvalidSpecError` naming the field. Parsed by
  :func:`parse_model` for ``spec.py``'s :func:`~mmis_operator.spec.parse_spec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmis_operator.spec_errors import InvalidSpecError
from mmis_operator.spec_fields import DEFAULTS, read_bytes, read_section

STORAGE_TYPES = ("EmptyDir", "PersistentVolumeClaim")
ACCESS_MODES = ("ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany")


@dataclasses.dataclass(frozen=True)
class StorageSpec:
    """Where the model cache lives: an emptyDir (``sizeLimit`` = ``size_bytes``, the same
    ephemeral-storage request), a claim the operator creates (``create_claim``, ``size_bytes``,
    ``storage_class``, ``access_mode``) or an existing claim (``claim_name``)."""

    type: str  # EmptyDir | PersistentVolumeClaim
    size_bytes: int
    claim_name: str | None  # an existing claim (not created, not deleted)
    storage_class: str | None
    access_mode: str

    @property
    def create_claim(self) -> bool:
        return self.type == "PersistentVolumeClaim" and self.claim_name is None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str  # the id or the path, whichever is set
    is_path: bool
    revision: str | None
    served_name: str
    processor_kwargs: Mapping[str, Any]
    storage: StorageSpec
    token_secret: tuple[str, str] | None  # (secret name, key): HF_TOKEN of the download


def parse_model(spec: Mapping[str, Any]) -> ModelSpec:
    """``spec.model`` of a raw spec (required)."""
    if "model" not in spec:
        raise InvalidSpecError("spec.model", "is required: set model.id or model.path")
    model = read_section(spec, "model")
    ident, path = model.get("id"), model.get("path")
    if bool(ident) == bool(path):
        raise InvalidSpecError(
            "spec.model",
            "set exactly one of id (a Hugging Face model id) or path (a directory inside the pod)",
        )
    if path and not str(path).startswith("/"):
        raise InvalidSpecError("spec.model.path", f"must be an absolute path, got {path!r}")
    name = str(ident or path)
    kwargs = model.get("processorKwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise InvalidSpecError("spec.model.processorKwargs", "must be an object")
    token = model.get("tokenSecretRef")
    if token is not None and (not isinstance(token, Mapping) or not token.get("name")):
        raise InvalidSpecError("spec.model.tokenSecretRef", "needs name (a Secret)")
    if token and path:
        raise InvalidSpecError(
            "spec.model.tokenSecretRef", "is for downloading model.id; model.path is not downloaded"
        )
    return ModelSpec(
        name=name,
        is_path=bool(path),
        revision=model.get("revision") or None,
        served_name=str(model.get("servedName") or name),
        processor_kwargs=dict(kwargs),
        storage=_storage(model),
        token_secret=(
            (str(token["name"]), str(token.get("key") or DEFAULTS["model.tokenSecretRef.key"]))
            if token
            else None
        ),
    )


def _storage(model: Mapping[str, Any]) -> StorageSpec:
    raw = model.get("storage") or {}
    if not isinstance(raw, Mapping):
        raise InvalidSpecError("spec.model.storage", "must be an object")
    kind = raw.get("type", DEFAULTS["model.storage.type"])
    if kind not in STORAGE_TYPES:
        raise InvalidSpecError(
            "spec.model.storage.type", f"must be one of {', '.join(STORAGE_TYPES)}, got {kind!r}"
        )
    mode = raw.get("accessMode", DEFAULTS["model.storage.accessMode"])
    if mode not in ACCESS_MODES:
        raise InvalidSpecError(
            "spec.model.storage.accessMode",
            f"must be one of {', '.join(ACCESS_MODES)}, got {mode!r}",
        )
    claim = raw.get("claimName") or None
    if claim and kind != "PersistentVolumeClaim":
        raise InvalidSpecError("spec.model.storage", "claimName needs type PersistentVolumeClaim")
    if claim and raw.get("storageClassName"):
        raise InvalidSpecError(
            "spec.model.storage",
            "set claimName (an existing claim) or storageClassName (a claim the operator "
            "creates), not both",
        )
    size = read_bytes(raw, "spec.model.storage.size") or 0
    if size <= 0:
        raise InvalidSpecError("spec.model.storage.size", "must be positive")
    return StorageSpec(
        type=kind,
        size_bytes=size,
        claim_name=claim,
        storage_class=raw.get("storageClassName") or None,
        access_mode=mode,
    )
