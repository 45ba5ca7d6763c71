"""The video decoder and frame sampler (``mmis.frontend.client.media.video``) on clips built
here with PyAV: evenly spread targets at the configured rate within the frame limits, distinct
frames in order, every frame of a clip shorter than the minimum, the sampled rate reported, and
typed 400s for corrupt data, unknown containers and limits read from the headers."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mmis.frontend.client.media.video import (
    InvalidVideoError,
    VideoLimits,
    VideoTooLargeError,
    container_format,
    decode_video,
    sample_times,
)


def clip(num_frames: int, fps: int, size: int = 32, fmt: str = "mp4") -> bytes:
    """Frame i is a flat grey of value 6 * i (its index, readable after decoding)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 20_000_000  # near lossless: each frame's grey level stays readable
        for i in range(num_frames):
            frame = np.full((size, size, 3), 6 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def indices(frames: np.ndarray) -> list[int]:
    return [round(float(f.mean()) / 6) for f in frames]


def test_sample_times_follow_the_rate_within_the_limits() -> None:
    limits = VideoLimits(fps=2.0, min_frames=4, max_frames=6)
    assert sample_times(2.0, limits) == [0.0, 0.5, 1.0, 1.5]  # 2 s at 2 fps
    assert sample_times(0.5, limits) == [0.0, 0.125, 0.25, 0.375]  # raised to min_frames
    assert sample_times(60.0, limits) == [k * 10.0 for k in range(6)]  # capped, spread evenly
    assert len(sample_times(1.0, VideoLimits(min_frames=8, max_frames=3))) == 3  # max wins


def test_decoding_samples_distinct_frames_in_order_at_the_rate() -> None:
    video = decode_video(clip(8, fps=4), VideoLimits(fps=2.0, min_frames=2))
    assert video.frames.shape == (4, 32, 32, 3) and video.frames.dtype == np.uint8
    assert indices(video.frames) == [0, 2, 4, 6]
    assert video.duration_s == pytest.approx(2.0) and video.fps == pytest.approx(2.0)


def test_a_long_clip_is_capped_and_a_short_one_gives_every_frame() -> None:
    long = decode_video(clip(40, fps=8), VideoLimits(fps=2.0, max_frames=5))
    assert indices(long.frames) == [0, 8, 16, 24, 32] and long.fps == pytest.approx(1.0)
    short = decode_video(clip(3, fps=10), VideoLimits(fps=2.0, min_frames=4))
    assert indices(short.frames) == [0, 1, 2]  # fewer frames than min_frames: all of them
    assert short.fps == pytest.approx(10.0)


def test_webm_and_avi_containers_decode() -> None:
    assert container_format(clip(4, fps=4, fmt="matroska")) == "matroska"
    assert container_format(clip(4, fps=4, fmt="avi")) == "avi"
    assert decode_video(clip(4, fps=4, fmt="avi"), VideoLimits()).num_frames == 4


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "not a video"),
        (b"#EXTM3U\n#EXT-X-TARGETDURATION:1\nhttp://10.0.0.1/x.ts\n", "not a video"),  # HLS
        (b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64, "cannot be opened"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "not a video"),
    ],
)
def test_bad_data_is_a_typed_error(data: bytes, words: str) -> None:
    with pytest.raises(InvalidVideoError, match=words) as caught:
        decode_video(data, VideoLimits(), param="messages[0].content[0]")
    assert caught.value.param == "messages[0].content[0]"


def test_a_truncated_clip_is_refused_or_gives_its_decodable_frames() -> None:
    data = clip(8, fps=4)
    try:
        video = decode_video(data[: len(data) // 2], VideoLimits())
    except InvalidVideoError:
        return
    assert 0 < video.num_frames <= 4


def test_limits_from_the_headers() -> None:
    with pytest.raises(VideoTooLargeError, match="video_max_frame_pixels"):
        decode_video(clip(4, fps=4, size=64), VideoLimits(max_frame_pixels=32 * 32))
    with pytest.raises(VideoTooLargeError, match="video_max_duration_s"):
        decode_video(clip(12, fps=1), VideoLimits(max_duration_s=10.0))
