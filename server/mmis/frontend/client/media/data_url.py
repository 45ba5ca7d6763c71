"""``data:`` URLs (RFC 2397) carrying an encoded image.

Invariants:
- The size limit is checked on the *encoded* length before anything is decoded, so a huge
  data URL costs no allocation beyond the request body itself.
- Base64 is decoded strictly (``validate=True``; whitespace is stripped first): garbage is a
  400 naming the problem, never silently skipped characters.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import urllib.parse

from mmis.frontend.errors import InvalidMediaError, MediaTooLargeError


@dataclasses.dataclass(frozen=True)
class DataURL:
    media_type: str
    data: bytes


def parse_data_url(url: str, *, max_bytes: int, param: str | None = None) -> DataURL:
    """Decode ``data:[<media type>][;base64],<payload>`` into bytes (at most ``max_bytes``)."""
    if not url[:5].lower() == "data:":
        raise InvalidMediaError("not a data: URL", param=param)
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise InvalidMediaError(
            "malformed data: URL: expected 'data:<media type>;base64,<data>' (no comma found)",
            param=param,
        )
    parts = [p.strip() for p in header.split(";")]
    is_base64 = len(parts) > 1 and parts[-1].lower() == "base64"
    media_type = parts[0].lower() or "text/plain"
    if is_base64:
        compact = "".join(payload.split())
        if len(compact) // 4 * 3 > max_bytes + 2:
            raise _too_large(max_bytes, param)
        try:
            data = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidMediaError(
                f"image data URL is not valid base64 ({exc})", param=param
            ) from exc
    else:
        if len(payload) > 3 * max_bytes:
            raise _too_large(max_bytes, param)
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(max_bytes, param)
    if not data:
        raise InvalidMediaError("image data URL is empty", param=param)
    return DataURL(media_type=media_type, data=data)


def _too_large(max_bytes: int, param: str | None) -> MediaTooLargeError:
    return MediaTooLargeError(
        f"image data URL is larger than the limit of {max_bytes} bytes", param=param
    )
