"""Skip transformers' full-size channels-first copy of a PIL image before the resize (issue 45).

transformers 5.23-5.24's ``TorchvisionBackend.process_image`` turns a PIL image into a
channels-last numpy array, permutes it to channels-first and calls ``.contiguous()``: a
full-size copy, after which torchvision's uint8 bicubic resize of the channels-first layout
costs about 3x the resize of the channels-last view (32-40 ms vs 10-13 ms per 4-12 MP photo).
:func:`install` wraps one image processor *instance*'s ``process_image`` so that a PIL image
is returned as the channels-first *view* over the channels-last array, without that copy.

Invariants:
- The same tensors: the view holds the same values, shape and dtype as the original's
  contiguous tensor, and every later step (resize, rescale, normalize, patching) produces
  bit-identical outputs from it (tests/frontend/test_fast_image.py checks every tiny family).
- Only the path that is known: a PIL image, no ``device``, and either ``do_convert_rgb``
  (PIL's conversion to RGB, exactly the original's call) or a mode that is already 3-D
  (``RGB``/``RGBA``). Anything else (numpy/torch inputs, ``L``/``P`` without conversion, a
  device) calls the original unchanged.
- Installed only on an instance whose class uses ``TorchvisionBackend.process_image`` itself
  (not an override), in a transformers whose method is the one checked here (5.23-5.24, the
  pinned range): elsewhere :func:`install` changes nothing and returns False.
"""

from __future__ import annotations

from typing import Any

# the transformers releases whose TorchvisionBackend.process_image this reproduces
_CHECKED = ("5.23.", "5.24.")


_FAST: dict[type, type] = {}  # image processor class -> its subclass with the fast path


def install(image_processor: Any) -> bool:
    """Give ``image_processor`` (this instance only) the fast ``process_image``; True if it has
    it. The instance's class becomes a subclass of the same name that overrides only
    ``process_image``: the instance's attributes (what ``to_dict``/``save_pretrained`` write)
    are not touched."""
    try:
        import transformers
        from PIL import Image
        from transformers import image_processing_backends as backends
    except ImportError:
        return False
    cls = type(image_processor)
    if cls in _FAST.values():
        return True
    if not str(transformers.__version__).startswith(_CHECKED):
        return False
    base = getattr(backends, "TorchvisionBackend", None)
    convert = getattr(backends, "convert_to_rgb_pil", None)
    if base is None or convert is None or not isinstance(image_processor, base):
        return False
    if cls.process_image is not base.process_image:
        return False
    if cls not in _FAST:
        import numpy as np
        import torch

        original = base.process_image

        def process_image(
            self: Any,
            image: Any,
            do_convert_rgb: bool | None = None,
            input_data_format: Any = None,
            device: Any = None,
            **kwargs: Any,
        ) -> Any:
            if (
                device is not None
                or not isinstance(image, Image.Image)
                or not (do_convert_rgb or image.mode in ("RGB", "RGBA"))
            ):
                return original(self, image, do_convert_rgb, input_data_format, device, **kwargs)
            array = convert(image, return_numpy=True) if do_convert_rgb else np.array(image)
            if array.ndim != 3:
                return original(self, image, do_convert_rgb, input_data_format, device, **kwargs)
            return torch.from_numpy(array).permute(2, 0, 1)  # the view; the original copies it

        namespace = {
            "process_image": process_image,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        _FAST[cls] = type(cls.__name__, (cls,), namespace)
    image_processor.__class__ = _FAST[cls]
    return True


def is_installed(image_processor: Any) -> bool:
    """Whether ``image_processor`` has the fast ``process_image``."""
    return type(image_processor) in _FAST.values()
