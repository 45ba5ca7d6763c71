"""The workloads of ``mmis bench serve`` (``mmis.bench.datasets``): seeded, the repeat ratio
exact, every other image unique, JPEGs of the asked size; a folder of images with prompts."""

from __future__ import annotations

import base64
import io
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from mmis.bench.datasets import DatasetError, image_folder, random_mm


def decode(url: str) -> Image.Image:
    head, data = url.split(",", 1)
    assert head == "data:image/jpeg;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_seeded_same_requests_and_another_seed_differs() -> None:
    a = random_mm(5, num_images=2, width=32, height=24, input_len=7, output_len=9, seed=4)
    assert a == random_mm(5, num_images=2, width=32, height=24, input_len=7, output_len=9, seed=4)
    b = random_mm(5, num_images=2, width=32, height=24, input_len=7, output_len=9, seed=5)
    assert {i for r in a for i in r.images}.isdisjoint({i for r in b for i in r.images})
    assert a[0].prompt != b[0].prompt
    assert all(len(r.prompt.split()) == 7 and r.output_len == 9 for r in a)
    assert decode(a[0].images[0]).size == (32, 24)


@pytest.mark.parametrize(
    ("slots", "ratio", "repeats"), [(20, 0.25, 5), (30, 0.5, 15), (7, 0.0, 0), (4, 1.0, 3)]
)
def test_repeat_ratio_is_exact(slots: int, ratio: float, repeats: int) -> None:
    requests = random_mm(slots, width=8, height=8, repeat_ratio=ratio, seed=1)
    images = [i for r in requests for i in r.images]
    assert len(images) - len(set(images)) == repeats
    # every repeat shows an image first shown earlier; the first slot is always new
    first = {}
    for n, url in enumerate(images):
        first.setdefault(url, n)
    assert first[images[0]] == 0


def test_unique_images_are_distinct_bytes() -> None:
    images = [i for r in random_mm(6, num_images=3, width=8, height=8, seed=2) for i in r.images]
    assert max(Counter(images).values()) == 1


def test_bad_arguments_name_the_option() -> None:
    with pytest.raises(DatasetError, match="--random-mm-repeat-ratio"):
        random_mm(4, repeat_ratio=1.5)
    with pytest.raises(DatasetError, match="--num-prompts"):
        random_mm(0)


def test_image_folder_cycles_images_and_prompts(tmp_path: Path) -> None:
    for n, color in enumerate([(255, 0, 0), (0, 255, 0)]):
        Image.new("RGB", (10, 10), color).save(tmp_path / f"{n}.png")
    (tmp_path / "notes.md").write_text("not an image")
    (tmp_path / "prompts.txt").write_text("What is red?\n\nWhat is green?\nAnd blue?\n")
    requests = image_folder(tmp_path, 5, output_len=3)
    assert [r.prompt for r in requests] == [
        "What is red?",
        "What is green?",
        "And blue?",
        "What is red?",
        "What is green?",
    ]
    assert [r.images[0] for r in requests[:2]] == [r.images[0] for r in requests[2:4]]
    assert requests[0].images[0].startswith("data:image/png;base64,")
    assert requests[0].images != requests[1].images
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no image"):
        image_folder(tmp_path / "empty", 1)
