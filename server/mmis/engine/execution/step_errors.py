"""The runner's typed errors for a step it cannot execute (``runner.py``, ``encoder_store.py``,
``step_extras.py``): raised before the KV pool is written, answered per request by the core
(``engine/core.py`` ``_fail_step``)."""

from __future__ import annotations

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode


class StepInputError(MMISError, ValueError):
    """A step the runner cannot execute (a scheduler/glue bug or bad request data)."""

    code = ErrorCode.INVALID_REQUEST.value


class EncoderOutputMissingError(StepInputError):
    """A chunk overlaps an item whose embeddings are neither stored nor given tensors."""

    code = ErrorCode.INTERNAL.value
