"""The error every spec parser raises (:mod:`spec`, :mod:`autoscaling`, :mod:`monitoring`).

Invariant: ``field`` is the CRD path of the offending field (``spec.autoscaling.target``) and
the message says what to change; the reconciler turns it into ``Degraded`` (InvalidSpec).
"""

from __future__ import annotations


class InvalidSpecError(ValueError):
    """The spec cannot be turned into pods; ``field`` says where, the message says how to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
