"""The workloads of ``mmis bench serve``: a list of :class:`SampleRequest` built before the run.

- ``random-mm`` (:func:`random_mm`): ``num_prompts`` requests of ``num_images`` JPEG images of
  ``width`` x ``height`` uniform random pixels each, a prompt of ``input_len`` words and an
  output of ``output_len`` tokens. Everything comes from one ``numpy`` generator seeded with
  ``seed``: the same arguments give byte-identical requests. Of the ``num_prompts *
  num_images`` image slots exactly ``round(repeat_ratio * slots)`` (at most ``slots - 1``: the
  first slot is always new) repeat an image of an earlier slot, chosen at random; every other
  slot is an image no other slot holds (a distinct seed per unique image). No tokenizer is
  needed: the prompt is ``input_len`` common English words, about one token each in the BPE
  vocabularies of the served families, so ``prompt_len`` is that word count, not a token count.
- ``image-folder`` (:func:`image_folder`): the images of a local folder (sorted by name; jpg,
  jpeg, png, webp, gif, bmp), one per request, cycled when ``num_prompts`` exceeds them; the
  prompts of ``prompts.txt`` in that folder (one per line, blank lines skipped), cycled, or one
  default prompt.

Users asking in turn (``questions`` > 1, ``--questions-per-image``; an mmis workload: vLLM's
bench has none): request ``k`` is question ``k % questions`` of user ``k // questions``
(``--num-prompts`` counts the questions, the last user may ask fewer). A user's requests show
the same images (random-mm: one user's images, each a slot of the repeat ratio; image-folder:
image ``u`` of the folder, cycled) with a prompt each (random-mm: its own random words;
image-folder: prompt ``k``, cycled), carry ``session = u`` and put the images before the text
(``images_first``), so every question of a user shares the images' prompt prefix, as a person
asking about one photo does. The run sends a user's requests in order, each once the previous
answered (``mmis.bench.serve.run_requests``). With ``questions`` 1 (the default) every request
is its own user: ``session`` None, text before images, as vLLM sends them.

Images travel as ``data:`` URLs, so the run needs nothing but the endpoint. Invariant: this
module imports no torch and nothing of the server (an import-linter contract).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import mimetypes
from pathlib import Path

import numpy as np
from PIL import Image

DEFAULT_PROMPT = "Describe this image."
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp"})

# common short English words: one token each in the served families' vocabularies, mostly
_WORDS_TEXT = """
the of and to in is was for on are as with his they at be this from have or by one had not
but what all were when we there can an your which their said if do will each about how up
out them then she many some so these would other into has more her two like him see time
could no make than first been its who now people my made over did down only way find use may
water long little very after words called just where most know get through back much before
go good new write our used me man too any day same right look think also around another came
come work three word must because does part even place well such here take why things help
put years different away again off went old number great tell men say small every found
still between name should home big give air line set own under read last never us left end
along while might next sound below saw something thought both few those always looked show
large often together asked house world going want school important
"""
_WORDS = tuple(_WORDS_TEXT.split())


class DatasetError(ValueError):
    """A dataset that cannot be built from the given arguments (the message names the fix)."""


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One request of the workload: its prompt, its images (data URLs) and its output length;
    ``session``: the user it asks for (None: on its own), ``images_first``: the images before
    the text in its message (see the module docstring)."""

    prompt: str
    prompt_len: int
    images: tuple[str, ...]
    output_len: int
    session: int | None = None
    images_first: bool = False


def jpeg_data_url(seed: int, width: int, height: int, quality: int = 85) -> str:
    """A JPEG of uniform random pixels from ``seed``: the same seed, the same bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def image_slots(slots: int, repeat_ratio: float, rng: np.random.Generator) -> list[int]:
    """For each of ``slots`` image slots, the index of the unique image it shows.

    Exactly ``min(round(repeat_ratio * slots), slots - 1)`` slots repeat an image first shown
    in an earlier slot; the unique images are numbered 0, 1, ... in order of first showing.
    """
    if not 0.0 <= repeat_ratio <= 1.0:
        raise DatasetError(f"--random-mm-repeat-ratio must be in [0, 1], got {repeat_ratio}")
    if slots <= 0:
        return []
    repeats = min(round(repeat_ratio * slots), slots - 1)
    repeat_at = set(rng.choice(np.arange(1, slots), size=repeats, replace=False).tolist())
    out: list[int] = []
    unique = 0
    for slot in range(slots):
        if slot in repeat_at:
            out.append(int(rng.integers(0, unique)))
        else:
            out.append(unique)
            unique += 1
    return out


def _check_questions(questions: int) -> None:
    if questions < 1:
        raise DatasetError(f"--questions-per-image must be at least 1, got {questions}")


def _user(k: int, questions: int) -> tuple[int | None, bool]:
    """(``session``, ``images_first``) of request ``k``."""
    return (k // questions, True) if questions > 1 else (None, False)


def random_prompt(words: int, rng: np.random.Generator) -> str:
    """``words`` random common words (about as many tokens)."""
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), words))


def random_mm(
    num_prompts: int,
    *,
    num_images: int = 1,
    width: int = 512,
    height: int = 512,
    repeat_ratio: float = 0.0,
    input_len: int = 32,
    output_len: int = 128,
    seed: int = 0,
    questions: int = 1,
) -> list[SampleRequest]:
    """The ``random-mm`` workload (see the module docstring)."""
    if num_prompts < 1:
        raise DatasetError(f"--num-prompts must be at least 1, got {num_prompts}")
    if num_images < 0 or width < 1 or height < 1:
        raise DatasetError(
            f"--random-mm-num-images must be >= 0 and the image size positive, got "
            f"{num_images} images of {width}x{height}"
        )
    if input_len < 1 or output_len < 1:
        raise DatasetError("--random-input-len and --random-output-len must be at least 1")
    _check_questions(questions)
    users = -(-num_prompts // questions)
    rng = np.random.default_rng(seed)
    slots = image_slots(users * num_images, repeat_ratio, rng)
    # each unique image has its own seed, drawn from the run's generator
    image_seeds = rng.integers(0, 2**63 - 1, max(slots, default=-1) + 1)
    urls: dict[int, str] = {}
    out = []
    for k in range(num_prompts):
        u = k // questions
        images = []
        for index in slots[u * num_images : (u + 1) * num_images]:
            if index not in urls:
                urls[index] = jpeg_data_url(int(image_seeds[index]), width, height)
            images.append(urls[index])
        out.append(
            SampleRequest(
                random_prompt(input_len, rng),
                input_len,
                tuple(images),
                output_len,
                *_user(k, questions),
            )
        )
    return out


def _file_data_url(path: Path) -> str:
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def image_folder(
    directory: Path, num_prompts: int, *, output_len: int = 128, questions: int = 1
) -> list[SampleRequest]:
    """The ``image-folder`` workload (see the module docstring)."""
    _check_questions(questions)
    if not directory.is_dir():
        raise DatasetError(f"--dataset-path {directory}: not a directory of images")
    images = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise DatasetError(
            f"--dataset-path {directory}: no image ({', '.join(sorted(IMAGE_SUFFIXES))}) in it"
        )
    prompts_file = directory / "prompts.txt"
    prompts = [DEFAULT_PROMPT]
    if prompts_file.exists():
        prompts = [line.strip() for line in prompts_file.read_text().splitlines() if line.strip()]
        if not prompts:
            raise DatasetError(f"{prompts_file}: no prompt in it (one per line)")
    urls = [_file_data_url(p) for p in images[: -(-num_prompts // questions)]]
    return [
        SampleRequest(
            prompts[k % len(prompts)],
            len(prompts[k % len(prompts)].split()),
            (urls[k // questions % len(urls)],),
            output_len,
            *_user(k, questions),
        )
        for k in range(num_prompts)
    ]
