"""Media loading for P0: data/http(s)/file URLs -> size-checked bytes -> decoded RGB images
and sampled video frames.

See :mod:`.loader` for the entry point and each module for its invariants.
"""

from mmis.frontend.client.media.loader import LoadedImage, MediaLoader, check_image_count
from mmis.frontend.client.media.video import DecodedVideo

__all__ = ["DecodedVideo", "LoadedImage", "MediaLoader", "check_image_count"]
