"""The video decoder and frame sampler (``mmis.frontend.client.media.video``) on clips built
here with PyAV: evenly spread targets at the configured rate within the frame limits, distinct
frames in order, every frame of a clip shorter than the minimum, the sampled rate reported,
typed 400s for corrupt data, unknown containers and limits read from the headers, and a
truncated clip: a 400 for an MP4 (its index comes last), the frames up to the cut for a WebM
(streamable)."""

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
from mmis.frontend.errors import error_status


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


def test_a_truncated_mp4_is_refused_with_a_clear_400() -> None:
    """An MP4 as muxers write it unless told to "faststart": the frames ('mdat'), then the
    index that locates them ('moov'). Cut inside the frames, nothing can say where a frame
    is, so there are no "frames up to the cut" to give: a clear 400 (``invalid_video``,
    naming the part), never a guess."""
    data = clip(8, fps=4)
    mdat, moov = data.find(b"mdat"), data.find(b"moov")
    assert 0 < mdat < moov  # the index comes after the frames
    with pytest.raises(InvalidVideoError, match="cannot be opened") as caught:
        decode_video(data[: (mdat + moov) // 2], VideoLimits(), param="messages[0].content[1]")
    assert error_status(caught.value) == 400 and caught.value.code == "invalid_video"
    assert caught.value.param == "messages[0].content[1]"


def test_a_truncated_webm_gives_the_frames_up_to_the_cut() -> None:
    """Matroska/WebM is written to be streamed: its header first, then clusters of frames,
    each decodable when it has arrived. Cut anywhere, the answer is a clear 400 while no
    frame is complete (the cut is in the header or the first frame), and from then on the
    clip's first frames up to the cut, in order, each once: every frame that arrived is
    used (here every frame is a sampling target), and none is made up."""
    data = clip(8, fps=4, fmt="matroska")
    limits = VideoLimits(fps=4.0, min_frames=2)
    assert indices(decode_video(data, limits).frames) == list(range(8))
    counts: list[int] = []  # frames decoded at each cut, 0 for a refusal
    for cut in range(1, len(data), 4):
        try:
            decoded = decode_video(data[:cut], limits)
        except InvalidVideoError:
            counts.append(0)
            continue
        got = indices(decoded.frames)
        assert got == list(range(len(got))), (cut, got)
        # the rate of the frames sent: the clip's 4 fps, not 4 * arrived / 8 (the header's
        # whole duration); the duration is what they cover
        assert decoded.fps == pytest.approx(4.0), (cut, decoded.fps)
        assert decoded.duration_s == pytest.approx(len(got) / 4.0), (cut, decoded.duration_s)
        counts.append(len(got))
    assert counts == sorted(counts)  # more bytes never give fewer frames, or a refusal
    assert set(counts) == set(range(9))  # refused at first, then each frame as it arrives


def test_a_truncated_avi_never_repeats_a_frame() -> None:
    """An AVI cut inside a frame's packet decodes it as the previous frame with the rest
    concealed (FFmpeg marks it corrupt): it is dropped, so every cut gives the frames that
    arrived whole, each once, at the clip's rate (before: (0, 1, 1) at some cuts)."""
    data = clip(8, fps=4, fmt="avi")
    limits = VideoLimits(fps=4.0, min_frames=2)
    seen = set()
    for cut in range(1, len(data), 4):
        try:
            decoded = decode_video(data[:cut], limits)
        except InvalidVideoError:
            continue
        got = indices(decoded.frames)
        assert got == list(range(len(got))), (cut, got)
        assert decoded.fps == pytest.approx(4.0), (cut, decoded.fps)
        seen.add(len(got))
    assert seen == set(range(1, 9))


def test_every_cut_of_an_mp4_is_a_clear_400_or_its_frames() -> None:
    data = clip(8, fps=4)
    for cut in range(1, len(data), 2):
        try:
            got = indices(decode_video(data[:cut], VideoLimits(fps=4.0, min_frames=2)).frames)
        except InvalidVideoError:
            continue
        assert got == list(range(len(got))), (cut, got)


def test_limits_from_the_headers() -> None:
    with pytest.raises(VideoTooLargeError, match="video_max_frame_pixels"):
        decode_video(clip(4, fps=4, size=64), VideoLimits(max_frame_pixels=32 * 32))
    with pytest.raises(VideoTooLargeError, match="video_max_duration_s"):
        decode_video(clip(12, fps=1), VideoLimits(max_duration_s=10.0))
