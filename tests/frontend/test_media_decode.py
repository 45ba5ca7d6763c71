"""decode_image: S10's image inputs (non-image, truncated, huge header) at unit level."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from mmis.frontend.client.media.decode import decode_image
from mmis.frontend.config import DEFAULT_IMAGE_FORMATS
from mmis.frontend.errors import InvalidMediaError, MediaTooLargeError

LIMIT = 25_000_000


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def noisy(size: int = 96, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(0)
    channels = len(mode)
    pixels = rng.integers(0, 256, (size, size, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(), mode=mode)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that *claims* width x height but holds a few bytes of pixel data: costs nothing."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def decode(data: bytes, max_pixels: int = LIMIT) -> Image.Image:
    return decode_image(data, max_pixels=max_pixels, formats=DEFAULT_IMAGE_FORMATS, param="p")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_valid_images_decode_to_rgb(fmt: str) -> None:
    source = noisy(32)
    image = decode(encode(source, fmt))
    assert image.mode == "RGB"
    assert image.size == (32, 32)
    if fmt in ("PNG", "BMP"):  # lossless: the very same pixels
        assert np.array_equal(np.asarray(image), np.asarray(source))


def test_non_image_is_a_400_naming_the_formats() -> None:
    with pytest.raises(InvalidMediaError, match="not an image") as info:
        decode(b"this is plain text, not a picture")
    assert info.value.status == 400
    assert info.value.code == "invalid_image"
    assert info.value.param == "p"


def test_format_outside_the_allow_list_is_refused() -> None:
    # TIFF is a real image PIL can read, but not in the default allow list
    with pytest.raises(InvalidMediaError, match="supported format"):
        decode(encode(noisy(16), "TIFF"))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_is_a_400_not_a_partial_image(fmt: str) -> None:
    data = encode(noisy(128), fmt)
    with pytest.raises(InvalidMediaError, match="truncated or corrupt") as info:
        decode(data[: len(data) // 2])
    assert info.value.status == 400


def test_corrupt_header_is_a_400() -> None:
    data = bytearray(encode(noisy(16)))
    data[16:24] = b"\xff" * 8  # width/height in IHDR, now CRC-mismatched
    with pytest.raises(InvalidMediaError):
        decode(bytes(data))


def test_20000_square_header_is_refused_naming_the_limit() -> None:
    data = png_header_only(20_000, 20_000)
    assert len(data) < 200  # nothing like 400M pixels is ever allocated
    with pytest.raises(MediaTooLargeError, match=f"limit of {LIMIT} pixels") as info:
        decode(data)
    assert info.value.status == 400
    assert info.value.code == "media_too_large"


def test_pixel_limit_is_checked_from_the_header_before_decoding() -> None:
    # 6000x6000 is under PIL's own bomb limit, so only our check can refuse it; the file has
    # almost no pixel data, so decoding first would have raised "truncated" instead.
    with pytest.raises(MediaTooLargeError, match="6000x6000 = 36000000 pixels"):
        decode(png_header_only(6000, 6000))
    # and the same header under a larger limit does get decoded -- and is truncated
    with pytest.raises(InvalidMediaError, match="truncated"):
        decode(png_header_only(6000, 6000), max_pixels=40_000_000)


def test_pixel_limit_boundary() -> None:
    data = encode(noisy(100))
    assert decode(data, max_pixels=10_000).size == (100, 100)
    with pytest.raises(MediaTooLargeError):
        decode(data, max_pixels=9_999)


def test_transparency_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))
    image = decode(encode(rgba))
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (255, 0, 0)


def test_grayscale_and_palette_become_rgb() -> None:
    assert decode(encode(noisy(8, "L"))).mode == "RGB"
    assert decode(encode(noisy(8).convert("P"))).mode == "RGB"


def test_refuses_to_run_when_truncated_loading_is_enabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode(encode(noisy(8)))
