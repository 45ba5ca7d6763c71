from __future__ import annotations

from decimal import Decimal

import pytest

from mmis_operator import spec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4Gi", Decimal(4 * 2**30)),
        ("1.5Gi", Decimal(3 * 2**29)),
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("1G", Decimal(10**9)),
        ("2e3", Decimal(2000)),
        ("128Ki", Decimal(128 * 1024)),
        (3, Decimal(3)),
    ],
)
def test_parse(text: object, expected: Decimal) -> None:
    assert spec.parse(text, "f") == expected


@pytest.mark.parametrize("bad", ["", "4GiB", "four", "1.2.3", "Gi", True, None, [1]])
def test_parse_rejects_with_field(bad: object) -> None:
    with pytest.raises(spec.QuantityError, match=r"^spec\.x: .* is not a Kubernetes quantity"):
        spec.parse(bad, "spec.x")


def test_parse_bytes_rounds_up_and_rejects_negative() -> None:
    assert spec.parse_bytes("1.1", "f") == 2
    with pytest.raises(spec.QuantityError):
        spec.parse_bytes("-1Gi", "f")


@pytest.mark.parametrize(
    ("count", "text"),
    [(3 * 2**30, "3Gi"), (2**29 + 2**30, "1536Mi"), (1000, "1000"), (0, "0"), (2048, "2Ki")],
)
def test_format_bytes_is_exact_and_round_trips(count: int, text: str) -> None:
    assert spec.format_bytes(count) == text
    assert spec.parse_bytes(text, "f") == count


def test_gib() -> None:
    assert spec.gib(4 * 2**30) == "4"
    assert spec.gib(2**29) == "0.5"
    assert spec.gib(0) == "0"
