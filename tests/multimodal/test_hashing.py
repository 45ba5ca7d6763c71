"""The item hash: distinct structures never collide, equal content always agrees."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmis.multimodal.hashing import (
    MAX_UUID_LENGTH,
    HashingError,
    InvalidItemUUIDError,
    UnhashableValueError,
    UnknownHashAlgorithmError,
    encoded_item_mm_hash,
    hash_item,
    hash_value,
    item_mm_hash,
    validate_uuid,
)

RAW = bytes(range(6))


def _img(mode: str, size: tuple[int, int], raw: bytes = RAW) -> Image.Image:
    return Image.frombytes(mode, size, raw)


def _h(item: Any, **kwargs: Any) -> str:
    return hash_item(model_id="m", modality="image", item=item, **kwargs)


def test_same_pixels_same_hash_across_encodings() -> None:
    rgb = Image.new("RGB", (8, 4), (10, 20, 30))
    png, bmp = io.BytesIO(), io.BytesIO()
    rgb.save(png, "PNG")
    rgb.save(bmp, "BMP")
    from_png = Image.open(io.BytesIO(png.getvalue()))
    from_bmp = Image.open(io.BytesIO(bmp.getvalue()))
    from_png.load()
    from_bmp.load()
    assert _h(from_png) == _h(from_bmp) == _h(rgb)
    assert _h(png.getvalue()) != _h(bmp.getvalue())  # encoded bytes hash as bytes
    assert _h(png.getvalue()) != _h(rgb)


def test_mode_L_vs_P_vs_RGB_with_same_bytes() -> None:
    gray = _img("L", (3, 2))
    pal = _img("P", (3, 2))
    rgb = _img("RGB", (1, 2))
    assert gray.tobytes() == pal.tobytes() == rgb.tobytes() == RAW
    assert len({_h(gray), _h(pal), _h(rgb)}) == 3
    # same size, same bytes, no palette anywhere: only the mode tells them apart
    three = [_img(mode, (1, 2)) for mode in ("RGB", "YCbCr", "HSV", "LAB")]
    assert all(img.palette is None and img.tobytes() == RAW for img in three)
    assert len({_h(img) for img in three}) == 4


def test_palette_changes_hash() -> None:
    a = _img("P", (3, 2))
    b = _img("P", (3, 2))
    a.putpalette([0, 0, 0] * 256)
    b.putpalette([255, 0, 0] + [0, 0, 0] * 255)
    assert a.tobytes() == b.tobytes()
    assert _h(a) != _h(b)


def test_transparency_changes_hash() -> None:
    a = _img("P", (3, 2))
    b = _img("P", (3, 2))
    b.info["transparency"] = 0
    assert _h(a) != _h(b)


def test_transposed_shape_with_same_bytes() -> None:
    assert _h(_img("L", (2, 3))) != _h(_img("L", (3, 2)))
    flat = np.arange(6, dtype=np.uint8)
    assert _h(flat.reshape(2, 3)) != _h(flat.reshape(3, 2))
    assert _h(flat.reshape(2, 3)) != _h(flat)


def test_array_dtype_and_layout() -> None:
    a = np.zeros(4, dtype=np.uint8)
    assert _h(a) != _h(a.view(np.int8))
    assert _h(np.zeros(2, dtype="<u2")) != _h(np.zeros(2, dtype=">u2"))
    m = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert _h(m.T) == _h(np.ascontiguousarray(m.T))  # content, not memory layout
    assert _h(m.T) != _h(m)
    with pytest.raises(UnhashableValueError, match="object"):
        _h(np.array([object()]))


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ([1, 2], (1, 2)),
        ([[1], 2], [1, [2]]),
        ([[1, 2]], [1, 2]),
        ([], None),
        ("", None),
        (b"", None),
        ({}, None),
        ({}, []),
        ("ab", b"ab"),
        (1, 1.0),
        (1, True),
        (0, False),
        (1, "1"),
        (["ab", "c"], ["a", "bc"]),
        (["as", ""], ["a", "s"]),  # collides if lengths were not framed
        ([b"ab", b""], [b"a", b"b"]),
        ({"a": "bc"}, {"ab": "c"}),
        ({"a": None}, {"a": ""}),
        ({"a": 1}, {"a": 1, "b": None}),
        (np.array(1, dtype=np.int64), 1),
    ],
)
def test_distinct_structures_never_collide(left: Any, right: Any) -> None:
    assert hash_value(left) != hash_value(right)


def test_dict_key_order_invariance_nested() -> None:
    a = {"size": {"h": 4, "w": 8}, "do_resize": True, "mean": [0.5, 0.5]}
    b = {"mean": [0.5, 0.5], "do_resize": True, "size": {"w": 8, "h": 4}}
    assert list(a) != list(b)
    assert hash_value(a) == hash_value(b)
    img = _img("L", (3, 2))
    assert _h(img, processor_kwargs=a) == _h(img, processor_kwargs=b)
    assert _h(img, processor_kwargs=a) != _h(img, processor_kwargs={**a, "do_resize": False})
    assert _h(img) == _h(img, processor_kwargs={}) == _h(img, processor_kwargs=None)


def test_model_and_modality_are_bound() -> None:
    img = _img("L", (3, 2))
    base = hash_item(model_id="m", modality="image", item=img)
    assert base != hash_item(model_id="m2", modality="image", item=img)
    assert base != hash_item(model_id="m", modality="video", item=img)
    # moving characters between adjacent fields must not collide
    assert hash_item(model_id="ab", modality="c", item=b"") != hash_item(
        model_id="a", modality="bc", item=b""
    )


def test_algorithm_selection_changes_digest() -> None:
    img = _img("L", (3, 2))
    b3 = _h(img, algorithm="blake3")
    sha = _h(img, algorithm="sha256")
    assert b3 == _h(img)  # blake3 is the default
    assert b3 != sha
    assert len(b3) == len(sha) == 64
    with pytest.raises(UnknownHashAlgorithmError, match="md5"):
        _h(img, algorithm="md5")


def test_unsupported_values_raise_typed_errors() -> None:
    with pytest.raises(UnhashableValueError, match="set"):
        hash_value({1, 2})
    with pytest.raises(UnhashableValueError, match="PIL image"):
        hash_item(model_id="m", modality="image", item="not-an-image")  # type: ignore[arg-type]


def test_an_items_hash_is_its_contents_never_a_uuid() -> None:
    """A uuid names an item per tenant in P0 (frontend/client/tenancy.py); it is not a hash
    and cannot be given one: the hash is the content's (docs/SECURITY.md)."""
    img = _img("L", (3, 2))
    assert item_mm_hash(model_id="m", modality="image", item=img) == _h(img)
    with pytest.raises(TypeError, match="uuid"):
        item_mm_hash(model_id="m", modality="image", item=img, uuid="x")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("a\nb", "printable"),
        ("a\x00b", "printable"),
        ("x" * (MAX_UUID_LENGTH + 1), "limit"),
        (42, "string"),
    ],
)
def test_invalid_uuid_rejected_with_clear_message(bad: Any, message: str) -> None:
    with pytest.raises(InvalidItemUUIDError, match=message) as info:
        validate_uuid(bad)
    assert info.value.code == "invalid_request"
    assert info.value.to_wire().retryable is False


def test_item_without_data() -> None:
    with pytest.raises(HashingError, match="needs its data"):
        item_mm_hash(model_id="m", modality="image", item=None)


def test_an_encoded_item_is_its_bytes_under_its_decoder() -> None:
    """Images a request carries are hashed as their bytes with the decoder's identity
    (issue 45): the same bytes agree; other bytes, another decoder, model, modality or kwargs
    differ; and the framing never meets a pixel hash or bare bytes given to hash_item."""
    rgb = Image.new("RGB", (8, 4), (10, 20, 30))
    png, bmp = io.BytesIO(), io.BytesIO()
    rgb.save(png, "PNG")
    rgb.save(bmp, "BMP")

    def enc(data: bytes, decoder: str = "d1", **kwargs: Any) -> str:
        args: dict[str, Any] = {"model_id": "m", "modality": "image", **kwargs}
        return encoded_item_mm_hash(data=data, decoder=decoder, **args)

    base = enc(png.getvalue())
    assert base == enc(png.getvalue()) == enc(bytearray(png.getvalue()))
    assert base != enc(bmp.getvalue())  # the same pixels in other bytes: another item
    assert base != enc(png.getvalue(), decoder="d2")
    assert base != enc(png.getvalue(), model_id="m2")
    assert base != enc(png.getvalue(), modality="video")
    assert base != enc(png.getvalue(), processor_kwargs={"do_resize": False})
    assert base != enc(png.getvalue(), algorithm="sha256")
    assert base not in {_h(rgb), _h(png.getvalue()), _h(Image.open(png))}
    with pytest.raises(UnhashableValueError, match="must be bytes"):
        enc("not-bytes")  # type: ignore[arg-type]
