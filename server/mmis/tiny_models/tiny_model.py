"""Tiny, randomly initialised multimodal models built offline, for tests, benchmarks and demos.

Invariants:
- Deterministic: the same family and seed always give the same tokenizer, config and weights.
- Self-contained: the directory loads with plain ``AutoProcessor`` and
  ``AutoModelForImageTextToText.from_pretrained(dir)`` (and ``transformers serve dir``); nothing
  is downloaded. The tokenizer is a byte-level BPE trained here on a few sentences.
- Small: a few MB of weights at most.
- Atomic: a model directory is written under a temporary name and renamed into place, so a
  concurrent first use never sees (or leaves) a half-written model.
- Fingerprinted: each build writes :data:`FINGERPRINT_FILE` (a hash of its family's chat
  template and :data:`BUILD_REVISION`); a cached model whose fingerprint differs is moved
  aside and rebuilt on first use, so a template change reaches every cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from mmis.tiny_models.tiny_tokenizer import (
    LLAVA_SPECIALS,
    LLAVA_TEMPLATE,
    QWEN_SPECIALS,
    QWEN_TEMPLATE,
    token_ids,
    train_tokenizer,
)

# llava-siglip: a LLaVA whose tower has no CLS token (SigLIP, strategy "full");
# qwen2.5-vl: Qwen2.5-VL's windowed vision tower in front of the Qwen2-VL language model
# gemma3: sliding-window layers and bidirectional image tokens (tiny_gemma3.py);
# llava-next / llava-onevision: any-resolution tiles (tiny_llava_next.py)
FAMILIES = (
    "llava",
    "qwen2-vl",
    "qwen2.5-vl",
    "llava-siglip",
    "gemma3",
    "llava-next",
    "llava-onevision",
)
DEFAULT_FAMILY = "llava"


# families whose builder is a module of its own, mmis/tiny_models/tiny_<module>.py: it has
# ``build(out, seed, family)`` and ``TEMPLATE`` (the chat template, fingerprinted)
ELSEWHERE = {"llava-next": "llava_next", "llava-onevision": "llava_next", "gemma3": "gemma3"}

# bump when a builder changes what it writes (the templates are hashed in already);
# 2: tokenizers without control-byte tokens (tiny_tokenizer.CONTROL_CHARS)
BUILD_REVISION = 2
FINGERPRINT_FILE = "mmis-tiny-fingerprint.txt"


def fingerprint(family: str) -> str:
    """What a cached build of ``family`` must have been built with (its chat template)."""
    if family in ELSEWHERE:  # a builder module of its own names its template
        import importlib

        template = importlib.import_module(f"mmis.tiny_models.tiny_{ELSEWHERE[family]}").TEMPLATE
    else:
        template = QWEN_TEMPLATE if family.startswith("qwen") else LLAVA_TEMPLATE
    return hashlib.sha256(f"{BUILD_REVISION}\0{template}".encode()).hexdigest()[:16]


class TinyModelError(ValueError):
    """An unknown family or an unusable target directory."""


def _seeded(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _build_llava(out: Path, seed: int, *, siglip: bool = False) -> None:
    from transformers import (
        AutoModelForImageTextToText,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
        PreTrainedTokenizerFast,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(LLAVA_SPECIALS, 448),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.chat_template = LLAVA_TEMPLATE
    ids = token_ids(tokenizer, LLAVA_SPECIALS)
    image_size, patch_size = 32, 8
    tower: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    vision = SiglipVisionConfig(**tower) if siglip else CLIPVisionConfig(projection_dim=32, **tower)
    # SigLIP has no CLS token: its LLaVA checkpoints take every patch ("full")
    strategy: Literal["default", "full"] = "full" if siglip else "default"
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        initializer_range=0.2,
    )
    extra: dict[str, Any] = {"initializer_range": 0.2}
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-1,
        **extra,
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        text.bos_token_id,
        text.eos_token_id,
        text.pad_token_id,
    )
    image_processor: Any
    if siglip:
        image_processor = SiglipImageProcessor(size={"height": image_size, "width": image_size})
    else:
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=0 if siglip else 1,
        chat_template=LLAVA_TEMPLATE,
    )
    _seeded(seed)
    model = AutoModelForImageTextToText.from_config(config)
    _save(model, processor, out, ids["</s>"], ids["<pad>"], ids["<s>"])


# the hub checkpoints' image settings and context (Qwen2-VL-7B-Instruct): what real photos
# meet; the tiny default keeps images at 64x64 pixels so tests stay fast
HUB_QWEN2_VL = {"patch": 14, "min_pixels": 3136, "max_pixels": 12845056, "context": 32768}


def _build_qwen2_vl(out: Path, seed: int, *, v2_5: bool = False, hub: bool = False) -> None:
    from transformers import (
        AutoModelForImageTextToText,
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLProcessor,
        Qwen2VLConfig,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(QWEN_SPECIALS, 448),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )
    tokenizer.chat_template = QWEN_TEMPLATE
    ids = token_ids(tokenizer, QWEN_SPECIALS)
    patch, merge, temporal = (HUB_QWEN2_VL["patch"] if hub else 8), 2, 2
    extra: dict[str, Any] = {"initializer_range": 0.2}
    vision: dict[str, Any] = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,
        "num_heads": 4,
        "mlp_ratio": 2,
        "patch_size": patch,
        "spatial_merge_size": merge,
        "temporal_patch_size": temporal,
        "initializer_range": 0.2,
    }
    if v2_5:  # windowed attention in all blocks but the listed ones, SwiGLU MLPs
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "out_hidden_size": 64,
            "patch_size": patch,
            "spatial_merge_size": merge,
            "temporal_patch_size": temporal,
            "window_size": 32,
            "fullatt_block_indexes": [1],
            "initializer_range": 0.2,
        }
    config_cls: Any = Qwen2_5_VLConfig if v2_5 else Qwen2VLConfig
    config = config_cls(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": HUB_QWEN2_VL["context"] if hub else 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            "bos_token_id": ids["<|im_start|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "initializer_range": 0.2,
        },
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **extra,
    )
    config.bos_token_id = ids["<|im_start|>"]
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    size = {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}
    if hub:
        size = {
            "shortest_edge": HUB_QWEN2_VL["min_pixels"],
            "longest_edge": HUB_QWEN2_VL["max_pixels"],
        }
    common: dict[str, Any] = {
        "patch_size": patch,
        "merge_size": merge,
        "temporal_patch_size": temporal,
    }
    processor_cls: Any = Qwen2_5_VLProcessor if v2_5 else Qwen2VLProcessor
    processor = processor_cls(
        image_processor=Qwen2VLImageProcessor(size=size, **common),
        video_processor=Qwen2VLVideoProcessor(size=size, **common),
        tokenizer=tokenizer,
        chat_template=QWEN_TEMPLATE,
    )
    _seeded(seed)
    model = AutoModelForImageTextToText.from_config(config)
    _save(model, processor, out, ids["<|im_end|>"], ids["<|endoftext|>"], ids["<|im_start|>"])


def _save(model: Any, processor: Any, out: Path, eos: int, pad: int, bos: int) -> None:
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = eos, pad, bos
    gen.do_sample = False
    model.save_pretrained(out)
    processor.save_pretrained(out)


def _build_elsewhere(family: str) -> Any:
    """The builder of a family in :data:`ELSEWHERE`, imported when used."""

    def build(out: Path, seed: int) -> None:
        import importlib

        importlib.import_module(f"mmis.tiny_models.tiny_{ELSEWHERE[family]}").build(
            out, seed, family
        )

    return build


BUILDERS = {
    "llava": _build_llava,
    "llava-siglip": lambda out, seed: _build_llava(out, seed, siglip=True),
    "qwen2-vl": _build_qwen2_vl,
    "qwen2.5-vl": lambda out, seed: _build_qwen2_vl(out, seed, v2_5=True),
    # not a family of its own: Qwen2-VL with the hub's image settings and context
    "qwen2-vl-hub": lambda out, seed: _build_qwen2_vl(out, seed, hub=True),
    **{family: _build_elsewhere(family) for family in ELSEWHERE},
}


MODELS = tuple(BUILDERS)  # what can be built: the families and the hub-settings variant


def build_tiny_model(
    directory: str | os.PathLike[str], family: str = DEFAULT_FAMILY, seed: int = 0
) -> Path:
    """Write a tiny model of ``family`` into ``directory`` (created; must not hold a model).

    The files are written into a sibling temporary directory and renamed into place, so the
    target either holds a complete model or does not exist. Returns the target path.
    """
    if family not in BUILDERS:
        raise TinyModelError(f"unknown model family {family!r}; expected one of {MODELS}")
    target = Path(directory).expanduser().resolve()
    if target.exists() and any(target.iterdir()):
        raise TinyModelError(f"{target} exists and is not empty; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)
    try:
        BUILDERS[family](tmp, seed)
        (tmp / FINGERPRINT_FILE).write_text(fingerprint(family) + "\n")
        _plain_modes(tmp)
        os.rename(tmp, target)  # atomic; replaces an empty directory, fails on a full one
    except OSError:
        if not (target / "config.json").exists():
            raise  # not a concurrent builder winning the race: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _plain_modes(directory: Path) -> None:
    """Give every file the mode a plain ``open`` gives (0666 less the umask): safetensors
    writes the weights 0600, so a model built by root could not be served by uid 1000 (the
    operator's pods), and safetensors reports that as a missing file."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def model_cache_dir() -> Path:
    """Where built-in tiny models live: ``$MMIS_MODEL_CACHE`` or ``~/.cache/mmis/models``."""
    env = os.environ.get("MMIS_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mmis" / "models"


def tiny_model_dir(family: str = DEFAULT_FAMILY) -> Path:
    """The cached tiny model of ``family``, built on first use (concurrency-safe)."""
    if family not in BUILDERS:
        raise TinyModelError(f"unknown model family {family!r}; expected one of {MODELS}")
    target = model_cache_dir() / f"mmis-tiny-{family}"
    stamp = target / FINGERPRINT_FILE
    if (target / "config.json").exists() and not (
        stamp.exists() and stamp.read_text().strip() == fingerprint(family)
    ):
        _move_aside(target)  # built by other code: rebuild
    if not (target / "config.json").exists():
        try:
            build_tiny_model(target, family)
        except TinyModelError:
            if not (target / "config.json").exists():
                raise
    return target


def _move_aside(target: Path) -> None:
    """Rename a stale cached model out of the way (atomic) and delete it; a concurrent
    caller doing the same loses the rename harmlessly."""
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
    with contextlib.suppress(OSError):  # already moved by a concurrent caller
        os.rename(target, aside / "model")
    shutil.rmtree(aside, ignore_errors=True)


def default_model_dir() -> Path:
    """The built-in default model (tiny LLaVA), built into the cache on first use."""
    return tiny_model_dir(DEFAULT_FAMILY)
