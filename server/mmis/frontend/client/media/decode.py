"""Decode encoded image bytes into an RGB PIL image, safely.

Invariants:
- Only the configured formats are tried (no EPS/Ghostscript or other exotic decoders).
- The pixel count (width x height) is read from the header and checked *before* any pixel is
  decoded, so a tiny file claiming 20000x20000 pixels costs nothing; PIL's own decompression
  bomb error maps to the same typed error.
- The image is decoded fully (``Image.load()``): a truncated or corrupt file is a 400, never a
  half-grey image. This module never sets ``ImageFile.LOAD_TRUNCATED_IMAGES`` and refuses to
  decode if someone else did.
- The result is RGB; images with transparency are composited onto white.
- :func:`decoder_identity` names everything besides the bytes that decides the pixels this
  module returns (this module's conversion, :data:`DECODE_VERSION`; Pillow's version and its
  codec libraries'; the format list, whose order decides which plugin opens ambiguous bytes).
  The renderer hashes an image as its bytes with that identity
  (``multimodal/hashing.py`` ``encoded_item_mm_hash``), so any change to what
  :func:`decode_image` returns for some bytes must bump :data:`DECODE_VERSION`.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Final

import PIL
from PIL import Image, ImageFile, UnidentifiedImageError, features

from mmis.frontend.errors import InvalidMediaError, MediaTooLargeError

DECODE_VERSION: Final = "mmis-decode/1"
_LIBRARIES: Final = (
    "libjpeg_turbo",
    "jpg",
    "jpg_2000",
    "zlib",
    "zlib_ng",
    "libtiff",
    "webp",
    "avif",
)


@functools.lru_cache(maxsize=8)
def decoder_identity(formats: Sequence[str]) -> str:
    """What besides the bytes decides :func:`decode_image`'s pixels (see the module
    docstring), e.g. ``mmis-decode/1 Pillow=13.0.0 libjpeg_turbo=3.2.0 ... formats=JPEG,PNG``.
    ``formats``: a tuple (cached per tuple)."""
    versions = []
    for name in _LIBRARIES:
        try:
            version = features.version(name)
        except ValueError:  # a name this Pillow does not know
            version = None
        versions.append(f"{name}={version or '-'}")
    listed = ",".join(f.upper() for f in formats)
    return f"{DECODE_VERSION} Pillow={PIL.__version__} {' '.join(versions)} formats={listed}"


def decode_image(
    data: bytes,
    *,
    max_pixels: int,
    formats: Sequence[str],
    param: str | None = None,
) -> Image.Image:
    """Return the RGB image encoded in ``data``; raise a typed 400 for anything else."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set in this process; "
            "truncated images would be accepted silently"
        )
    try:
        image = Image.open(io.BytesIO(data), formats=[f.upper() for f in formats])
    except UnidentifiedImageError as exc:
        raise InvalidMediaError(
            f"the data is not an image in a supported format ({', '.join(formats)})",
            param=param,
        ) from exc
    except Image.DecompressionBombError as exc:  # PIL's own, far higher, hard limit
        raise _too_many_pixels(None, max_pixels, param) from exc
    except (OSError, ValueError, SyntaxError) as exc:  # PIL raises SyntaxError for bad headers
        raise InvalidMediaError(f"the image header is corrupt ({exc})", param=param) from exc
    try:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise InvalidMediaError(f"the image has an empty size {width}x{height}", param=param)
        if width * height > max_pixels:
            raise _too_many_pixels((width, height), max_pixels, param)
        try:
            image.load()
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise InvalidMediaError(
                f"the {image.format} image is truncated or corrupt ({exc})", param=param
            ) from exc
        rgb = _to_rgb(image)
    except BaseException:
        image.close()
        raise
    if rgb is not image:
        image.close()
    return rgb


def _to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB: itself when it already is (decoded, its pixels are its own: no copy
    of a 12 MP photo's 36 MB), else a converted copy."""
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (
        image.mode == "P" and "transparency" in image.info
    )
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _too_many_pixels(
    size: tuple[int, int] | None, max_pixels: int, param: str | None
) -> MediaTooLargeError:
    shown = f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels" if size else "too many pixels"
    return MediaTooLargeError(
        f"the image has {shown}, above the limit of {max_pixels} pixels (media_max_pixels)",
        param=param,
    )
