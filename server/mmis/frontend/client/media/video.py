"""Decode a video (MP4/MOV, Matroska/WebM, AVI) into sampled RGB frames, safely, with PyAV.

Invariants:
- The container is recognised from its magic bytes and opened with that demuxer explicitly:
  ffmpeg never probes, so no playlist/concat demuxer can open another URL or file.
- Limits are checked from the headers before any frame is decoded: a video stream exists,
  its frame size is at most ``max_frame_pixels`` (checked again on the first decoded frame,
  for codecs whose header has no size), its duration at most ``max_duration_s``
  (a stream whose frames run past that is refused while decoding, whatever it declared).
- Sampling (:func:`sample_times`): ``n = clamp(round(duration * fps), min_frames,
  max_frames)`` target times ``k * duration / n`` (k = 0..n-1); each takes the first
  not-yet-taken frame starting at or after it, so frames are distinct and in order, and a
  clip with fewer frames than ``n`` gives all of them. A frame the decoder marks corrupt
  (decoded from a cut packet, its gaps concealed with an earlier frame) is never taken.
  Decoding stops once every target is taken. The sampled rate (``len(frames) / duration``)
  is what the processor is told, so
  Qwen2.5-VL's ``second_per_grid_ts`` follows the frames actually sent. A stream whose
  frames end before the duration its header declares (a truncated WebM: the header names the
  whole clip) has ``duration`` = the time its frames cover (the last one's time plus one
  frame period), so the rate stays the sampling rate instead of falling with the missing
  frames.
- Every frame is converted to the first frame's size (``rgb24``): ``frames`` is one
  ``[T, H, W, 3]`` uint8 array. A video that cannot be decoded or has no frames is an
  :class:`InvalidVideoError` (400), one over a limit a :class:`VideoTooLargeError` (400); the
  container is always closed.
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np

from mmis.frontend.errors import InvalidMediaError, MediaTooLargeError

# demuxer chosen by the file's magic bytes (never probed)
_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (4, b"ftyp", "mov"),  # MP4, MOV, 3GP (ffmpeg's mov demuxer reads them all)
    (0, b"\x1a\x45\xdf\xa3", "matroska"),  # Matroska, WebM
    (0, b"RIFF", "avi"),  # checked further: bytes 8..12 are "AVI "
)


class InvalidVideoError(InvalidMediaError):
    """Not a video in a supported container, corrupt, or without frames."""

    code = "invalid_video"


class VideoTooLargeError(MediaTooLargeError):
    """A video over a limit (duration, frame size)."""


@dataclasses.dataclass(frozen=True)
class VideoLimits:
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 32
    max_duration_s: float = 600.0
    max_frame_pixels: int = 3840 * 2160


@dataclasses.dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8, the sampled frames in order
    fps: float  # sampled frames per second of video (len(frames) / duration)
    duration_s: float

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


def container_format(data: bytes) -> str | None:
    """The demuxer for ``data`` by its magic bytes, or None."""
    for offset, magic, name in _MAGIC:
        if data[offset : offset + len(magic)] == magic:
            if name == "avi" and data[8:12] != b"AVI ":
                return None
            return name
    return None


def sample_times(duration_s: float, limits: VideoLimits) -> list[float]:
    """The target times (seconds from the first frame) of the frames to sample."""
    wanted = round(duration_s * limits.fps)
    n = max(min(limits.min_frames, limits.max_frames), min(wanted, limits.max_frames))
    return [k * duration_s / n for k in range(n)]


def decode_video(data: bytes, limits: VideoLimits, *, param: str | None = None) -> DecodedVideo:
    """The sampled frames of the video in ``data``; a typed 400 for anything else."""
    import av

    name = container_format(data)
    if name is None:
        raise InvalidVideoError(
            "the data is not a video in a supported container (MP4/MOV, WebM/Matroska, AVI)",
            param=param,
        )
    try:
        container = av.open(io.BytesIO(data), mode="r", format=name)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise InvalidVideoError(f"the video cannot be opened ({exc})", param=param) from exc
    try:
        return _decode(container, limits, param)
    except av.FFmpegError as exc:
        raise InvalidVideoError(f"the video is corrupt ({exc})", param=param) from exc
    finally:
        container.close()


def _decode(container: object, limits: VideoLimits, param: str | None) -> DecodedVideo:
    streams = getattr(container, "streams")  # noqa: B009 (an av container, untyped)
    if not streams.video:
        raise InvalidVideoError("the file has no video stream", param=param)
    stream = streams.video[0]
    codec = stream.codec_context
    if codec is None:  # e.g. an MP4 cut inside its index: the stream has no decoder
        raise InvalidVideoError("the video stream cannot be decoded (truncated?)", param=param)
    stream.thread_type = "AUTO"
    _check_pixels(int(codec.width or 0), int(codec.height or 0), limits, param)
    duration = _duration(container, stream)
    if duration is None or duration <= 0:
        raise InvalidVideoError("the video declares no duration", param=param)
    _check_duration(duration, limits, param)
    targets = sample_times(duration, limits)
    frames: list[np.ndarray] = []
    first: float | None = None
    last = 0.0  # the latest decoded frame's time from the first
    size: tuple[int, int] | None = None
    k = 0
    decode = getattr(container, "decode")  # noqa: B009
    for frame in decode(stream):
        time = frame.time
        if time is None or frame.is_corrupt:  # e.g. the last frame of a truncated AVI: its
            continue  # missing part concealed with the previous frame's (a repeat, not data)
        first = time if first is None else first
        rel = last = float(time) - first
        _check_duration(rel, limits, param)
        if rel + 1e-6 < targets[k]:
            continue
        if size is None:  # a codec may only know the size once a frame is decoded
            size = (int(frame.width), int(frame.height))
            _check_pixels(size[0], size[1], limits, param)
        frames.append(frame.to_ndarray(width=size[0], height=size[1], format="rgb24"))
        while k < len(targets) and targets[k] <= rel + 1e-6:
            k += 1
        if k == len(targets):
            break
    if not frames:
        raise InvalidVideoError("the video has no decodable frames", param=param)
    if k < len(targets):  # the stream ended before its last target: truncated, or short
        rate = getattr(stream, "average_rate", None)
        period = 1.0 / float(rate) if rate else duration / len(targets)
        covered = last + period  # the time its frames cover (the last one's included)
        if covered < duration - 1e-3:  # it ended before the duration its header declared
            duration = covered
    return DecodedVideo(np.stack(frames), len(frames) / duration, duration)


def _duration(container: object, stream: object) -> float | None:
    """Seconds, from the stream's header, else the container's, else frames / rate."""
    import av

    value = getattr(stream, "duration", None)
    base = getattr(stream, "time_base", None)
    if value and base:
        return float(value * base)
    value = getattr(container, "duration", None)
    if value:
        return float(value) / av.time_base
    count, rate = getattr(stream, "frames", 0), getattr(stream, "average_rate", None)
    if count and rate:
        return float(count / rate)
    return None


def _check_pixels(width: int, height: int, limits: VideoLimits, param: str | None) -> None:
    if width * height > limits.max_frame_pixels:
        raise VideoTooLargeError(
            f"the video's frames are {width}x{height} = {width * height} pixels, above the "
            f"limit of {limits.max_frame_pixels} (video_max_frame_pixels)",
            param=param,
        )


def _check_duration(seconds: float, limits: VideoLimits, param: str | None) -> None:
    if seconds > limits.max_duration_s or not math.isfinite(seconds):
        raise VideoTooLargeError(
            f"the video is longer than the limit of {limits.max_duration_s:g} s "
            "(video_max_duration_s)",
            param=param,
        )
