"""data: URLs: strict base64, size limits before decoding, clear 400s."""

from __future__ import annotations

import base64

import pytest

from mmis.frontend.client.media.data_url import parse_data_url
from mmis.frontend.errors import InvalidMediaError, MediaTooLargeError

PAYLOAD = bytes(range(256)) * 4


def url_of(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_base64_round_trip() -> None:
    parsed = parse_data_url(url_of(PAYLOAD), max_bytes=10_000)
    assert parsed.data == PAYLOAD
    assert parsed.media_type == "image/png"


def test_whitespace_in_base64_is_tolerated() -> None:
    encoded = base64.b64encode(PAYLOAD).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    assert parse_data_url(f"data:image/png;base64,{wrapped}", max_bytes=10_000).data == PAYLOAD


@pytest.mark.parametrize(
    "payload",
    ["not*base64!", "QUJD=RA", "QUJDR", "////====////"],
    ids=["bad-chars", "padding-inside", "bad-length", "padding-middle"],
)
def test_broken_base64_is_a_400(payload: str) -> None:
    with pytest.raises(InvalidMediaError, match="not valid base64") as info:
        parse_data_url(f"data:image/png;base64,{payload}", max_bytes=10_000, param="x")
    assert info.value.status == 400
    assert info.value.param == "x"


def test_missing_comma_is_a_400() -> None:
    with pytest.raises(InvalidMediaError, match="no comma"):
        parse_data_url("data:image/png;base64", max_bytes=100)


def test_empty_payload_is_a_400() -> None:
    with pytest.raises(InvalidMediaError, match="empty"):
        parse_data_url("data:image/png;base64,", max_bytes=100)


def test_oversize_is_refused_before_decoding() -> None:
    # 1 MB of characters that are *not* valid base64: the size check must come first
    url = "data:image/png;base64," + "*" * 1_000_000
    with pytest.raises(MediaTooLargeError, match="limit of 1000 bytes"):
        parse_data_url(url, max_bytes=1000)


def test_size_limit_boundary() -> None:
    assert len(parse_data_url(url_of(PAYLOAD), max_bytes=len(PAYLOAD)).data) == len(PAYLOAD)
    with pytest.raises(MediaTooLargeError):
        parse_data_url(url_of(PAYLOAD), max_bytes=len(PAYLOAD) - 1)


def test_percent_encoded_data_url() -> None:
    parsed = parse_data_url("data:,hello%20world", max_bytes=100)
    assert parsed.data == b"hello world"
    assert parsed.media_type == "text/plain"
