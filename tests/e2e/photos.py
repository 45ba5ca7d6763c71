"""Photo-like test images for the e2e tests: smooth random colour fields, JPEG-encoded.

Invariant: the same size always gives the same bytes (the generator is seeded by the size).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def jpeg(width: int, height: int) -> bytes:
    """A ``width`` x ``height`` JPEG that looks like a photo to a processor, not a flat image."""
    rng = np.random.default_rng(width * height)
    coarse = rng.integers(0, 255, (height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return buf.getvalue()
