"""The typed errors of loading a LoRA adapter: each names its cause, the API turns it into a 400.

Invariants:
- Every refusal of an adapter is a :class:`LoRAError` subclass whose message names the adapter
  and the cause (the file, the rank and the limit, the module); nothing is half-loaded when one
  is raised (loading validates everything before it returns an adapter).
- :class:`LoRACapacityError` is the one runtime refusal (every device slot pinned by running
  requests): the scheduler keeps such a request waiting instead of raising it.
"""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served (the API's 400, ``invalid_request_error``)."""


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
