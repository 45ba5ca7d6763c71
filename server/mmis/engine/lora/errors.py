"""The typed LoRA refusals of the engine: each names its cause in its message and carries a
machine-readable ``code`` (:class:`~mmis.protocol.messages.ErrorCode`) that travels on the
wire, so P0 switches on codes, never on message texts.

Invariants:
- Every refusal of an adapter is a :class:`LoRAError` subclass whose message names the adapter
  and the cause (the file, the rank and the limit, the module); nothing is half-loaded when one
  is raised (loading validates everything before it returns an adapter).
- Every class's ``code`` is an ``ErrorCode`` value: the utility path
  (``engine/core_process.py``) answers a failed call with it as ``RequestError.code``, and the
  core refuses a request with it (``engine/core.py``). The load errors (files, config, rank,
  targets) are ``lora_invalid``; the others have one code each.
- :class:`LoRACapacityError` is the one runtime refusal (every device slot pinned by running
  requests): the scheduler keeps such a request waiting instead of raising it.
- Torch-free: the scheduler imports this module.
"""

from __future__ import annotations

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode


class LoRAError(MMISError, ValueError):
    """An adapter that cannot be served (the API's 400, ``invalid_request_error``)."""

    code = ErrorCode.LORA_INVALID.value


class LoRAFileError(LoRAError):
    """``adapter_config.json`` or ``adapter_model.safetensors`` missing, unreadable or corrupt."""


class LoRAConfigError(LoRAError):
    """A PEFT config mmis does not serve (not LoRA, DoRA, a bias, modules_to_save, ...)."""


class LoRARankError(LoRAError):
    """An adapter whose rank exceeds ``--max-lora-rank``."""


class LoRATargetError(LoRAError):
    """A target module the model lacks, or one whose shape differs from the model's."""


class LoRACapacityError(LoRAError):
    """No device slot free: every one holds an adapter that a running request uses."""


class LoRAAlreadyLoadedError(LoRAError):
    """A load under a name the engine holds already (P0 adopts the engine's entry)."""

    code = ErrorCode.LORA_ALREADY_LOADED.value


class LoRAIdReusedError(LoRAError):
    """A load under an id that is not positive or was used before in the engine's life
    (prefix-cache blocks are keyed by it: P0 tries its next id)."""

    code = ErrorCode.LORA_ID_REUSED.value


class LoRANotLoadedError(LoRAError):
    """A request or an unload naming an adapter the engine does not hold (P0: 404)."""

    code = ErrorCode.LORA_NOT_LOADED.value


class LoRAIdMismatchError(LoRAError):
    """A request naming a held adapter under another id (P0's entry is stale)."""

    code = ErrorCode.LORA_ID_MISMATCH.value


class LoRAInUseError(LoRAError):
    """An unload refused while a live request runs under the adapter (P0: 409)."""

    code = ErrorCode.LORA_IN_USE.value


class LoRAPreEncodedError(LoRAError):
    """A request whose images come pre-encoded (E/PD) under an adapter that changes the vision
    tower: invalid as sent (``invalid_request``, a 400 as any other)."""

    code = ErrorCode.INVALID_REQUEST.value


class LoRADisabledError(LoRAError):
    """A request naming an adapter on an engine without ``--enable-lora`` (P0 sends none:
    its registry is off; ``invalid_request``, a 400)."""

    code = ErrorCode.INVALID_REQUEST.value
