"""Video input end to end: a real ``mmis serve`` on the tiny Qwen2-VL, the openai SDK sending
``video_url`` parts with data: URLs of MP4 clips built here with PyAV.

- A clip is answered with 200 and the same greedy tokens as plain transformers ``generate()``
  on the frames P0 samples (same decoder, same settings) and the same prompt.
- The same clip again is a shadow hit (``mmis_shadow_hits_total`` + 1, sent without data) and
  a prefix-cache hit (``usage.prompt_tokens_details.cached_tokens`` > 0), same tokens.
- A long clip is sampled within ``--video-max-frames`` (6 frames: 3 temporal patches of 16
  tokens), a clip over ``--video-max-duration-s`` and a corrupt file are 400s with a message.
- ``POST /v1/responses`` takes the clip as an ``input_video`` part (the same templating as
  chat, ``frontend/api/templating.py``): the same prompt and the same answer as chat's; a
  video from an assistant turn is a 400 naming ``input_video``.
"""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import VIDEO_MAX_DURATION_S, VIDEO_MAX_FRAMES, Proc, openai_client

from mmis.frontend.client.media.video import VideoLimits, decode_video
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "What happens in the video?"
MAX_TOKENS = 6
MAX_FRAMES = VIDEO_MAX_FRAMES  # the server's limits (procs.FAMILY_FLAGS)
MAX_DURATION_S = VIDEO_MAX_DURATION_S
TOKENS_PER_PATCH = 16  # 64x64 frames, patch 8, merge 2: (8 / 2) ** 2 per temporal patch


def mp4(num_frames: int, fps: int, seed: int, size: int = 64) -> bytes:
    """An MPEG-4 clip of random frames drifting a little frame by frame."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (size, size, 3), dtype=np.int64)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = np.clip(base + 9 * i, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def served(family_serve: Callable[[str], Proc]) -> Proc:
    """The session's Qwen2-VL server (conftest.py): its video limits are MAX_FRAMES and
    MAX_DURATION_S."""
    return family_serve("qwen2-vl")


def client(proc: Proc) -> openai.OpenAI:
    return openai_client(proc)


def ask(proc: Proc, video: bytes) -> Any:
    return client(proc).chat.completions.create(
        model="m",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": data_url(video)}},  # type: ignore[misc,list-item]
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
    )


def shadow_hits(proc: Proc) -> float:
    text = httpx.get(proc.root_url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == "mmis_shadow_hits_total"
    )


def reference_text(video: bytes) -> str:
    """transformers' greedy answer on the frames P0 samples (the server's settings)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.video_utils import VideoMetadata

    model_dir = tiny_model_dir("qwen2-vl")
    clip = decode_video(video, VideoLimits(max_frames=MAX_FRAMES, max_duration_s=MAX_DURATION_S))
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n = clip.num_frames
    inputs = processor(
        text=[prompt],
        videos=[clip.frames],
        video_metadata=[
            VideoMetadata(total_num_frames=n, fps=clip.fps, frames_indices=list(range(n)))
        ],
        do_sample_frames=False,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=[])
    new = out[0, inputs["input_ids"].shape[1] :]
    return str(processor.tokenizer.decode(new, skip_special_tokens=True))


def test_video_matches_generate_then_hits_the_caches(served: Proc) -> None:
    video = mp4(8, fps=4, seed=1)  # 2 s: 4 frames at 2 fps
    first = ask(served, video)
    assert first.usage is not None and first.usage.completion_tokens == MAX_TOKENS
    assert first.choices[0].message.content == reference_text(video)
    hits = shadow_hits(served)
    again = ask(served, video)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert shadow_hits(served) == hits + 1  # the clip went without its tensors
    assert again.usage is not None and again.usage.prompt_tokens == first.usage.prompt_tokens
    details = again.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0


def test_a_long_clip_is_sampled_within_the_frame_limit(served: Proc) -> None:
    short = ask(served, mp4(8, fps=4, seed=2))  # 4 frames: 2 temporal patches
    long = ask(served, mp4(40, fps=8, seed=3))  # 5 s: 10 wanted, capped at 6: 3 patches
    assert short.usage is not None and long.usage is not None
    assert long.usage.prompt_tokens - short.usage.prompt_tokens == TOKENS_PER_PATCH


def _video_turn(role: str, video: bytes) -> list[dict[str, object]]:
    return [
        {
            "role": role,
            "content": [
                {"type": "input_video", "video_url": data_url(video)},
                {"type": "input_text", "text": PROMPT},
            ],
        }
    ]


def test_responses_take_a_video_part_as_chat_does(served: Proc) -> None:
    video = mp4(8, fps=4, seed=6)
    chat = ask(served, video)
    response = client(served).responses.create(
        model="m",
        input=_video_turn("user", video),  # type: ignore[arg-type]
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt
    assert response.usage.output_tokens == MAX_TOKENS
    with pytest.raises(openai.BadRequestError) as caught:
        client(served).responses.create(
            model="m",
            input=_video_turn("assistant", video),  # type: ignore[arg-type]
            max_output_tokens=MAX_TOKENS,
        )
    assert "input_video" in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("video", "words"),
    [
        (b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64, "video"),  # an MP4 header, no movie
        (b"GIF89a not a video", "not a video"),
        (None, "video_max_duration_s"),  # 12 s at 1 fps, over the 10 s limit
    ],
)
def test_bad_videos_are_400s_with_a_message(served: Proc, video: bytes | None, words: str) -> None:
    data = mp4(12, fps=1, seed=4) if video is None else video
    with pytest.raises(openai.BadRequestError) as caught:
        ask(served, data)
    assert caught.value.status_code == 400
    assert words in str(caught.value), str(caught.value)
    assert ask(served, mp4(8, fps=4, seed=5)).usage is not None  # the server still serves
