"""Kubernetes quantities ("4Gi", "500m", "1.5G", "2e3") parsed and written back.

Invariants:
- Parsing is exact (``Decimal``): "1.5Gi" is exactly 1.5 * 2**30.
- A malformed quantity raises :class:`QuantityError` naming the field, never ``ValueError``.
- ``format_bytes`` writes the largest binary suffix that represents the value exactly, so a
  round trip through the API server never changes the number.
"""

from __future__ import annotations

import re
from decimal import Decimal

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_PATTERN = re.compile(
    r"^(?P<num>[+-]?(?:\d+\.?\d*|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)
GiB = 1 << 30


class QuantityError(ValueError):
    """A spec field holds something that is not a Kubernetes quantity."""

    def __init__(self, field: str, value: object) -> None:
        super().__init__(
            f"{field}: {value!r} is not a Kubernetes quantity (examples: 4Gi, 512Mi, 2, 500m)"
        )
        self.field = field
        self.value = value


def parse(value: object, field: str) -> Decimal:
    """Parse an int, float or quantity string; returns the value in base units."""
    if isinstance(value, bool):
        raise QuantityError(field, value)
    if isinstance(value, int | float):
        return Decimal(str(value))
    if not isinstance(value, str):
        raise QuantityError(field, value)
    match = _PATTERN.match(value.strip())
    if match is None:
        raise QuantityError(field, value)
    number = Decimal(match["num"])  # the pattern admits only decimals
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        return number * (Decimal(1024) ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number * (Decimal(10) ** _DECIMAL[suffix])
    return number * (Decimal(10) ** int(suffix[1:]))


def parse_bytes(value: object, field: str) -> int:
    """Parse a memory quantity into whole bytes (rounded up); negative is an error."""
    amount = parse(value, field)
    if amount < 0:
        raise QuantityError(field, value)
    return int(amount.to_integral_value(rounding="ROUND_CEILING"))


def format_bytes(count: int) -> str:
    """Write a byte count with the largest exact binary suffix (``3221225472`` -> ``3Gi``)."""
    if count < 0:
        raise ValueError(f"negative byte count {count}")
    for suffix, power in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        unit = 1024**power
        if count and count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)


def gib(count: int) -> str:
    """Bytes as a GiB decimal string for the ``--*-gb`` CLI flags (at most 4 decimals)."""
    text = f"{count / GiB:.4f}".rstrip("0").rstrip(".")
    return text or "0"
