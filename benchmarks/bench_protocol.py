"""Wire codec vs pickle: round trip of an add request carrying one 448x448 image.

    .venv/bin/python benchmarks/bench_protocol.py [--repeat N] [--check]

Two processor layouts of the same image (one MultiModalFeature each):
- clip:    pixel_values float32 [1, 3, 448, 448]                       (2.4 MB)
- qwen2vl: pixel_values float32 [1024, 1176] + image_grid_thw int64 [1, 3]  (4.8 MB)

Three ways of moving the message, each against pickle (default protocol) of the same
EngineCoreRequest measured in the same run:
- in-process: encode + decode (codec: frames are views, pickle: dumps + loads);
- one copy:   as above, but every codec frame is copied to ``bytes`` first, as a transport
              that cannot send zero-copy would (a conservative lower bound for the ratio);
- zmq inproc: send over a real ZMQ PAIR socket and decode on the other side
              (codec: ``send_multipart(copy=False)``, pickle: one ``send`` of the dumps).

Times are the best of ``--repeat`` runs of a timeit loop (medians printed too). The target
is codec >= 2x faster than pickle for the in-process round trip.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from mmis.protocol import (
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
    decode_request,
    encode_request,
)

TARGET = 2.0


def make_request(layout: str) -> EngineCoreRequest:
    rng = np.random.default_rng(0)
    if layout == "clip":
        data: dict[str, Any] = {"pixel_values": rng.random((1, 3, 448, 448), dtype=np.float32)}
        tokens = 256
    else:
        data = {
            "pixel_values": rng.random((1024, 1176), dtype=np.float32),
            "image_grid_thw": np.array([[1, 32, 32]], dtype=np.int64),
        }
        tokens = 256
    feature = MultiModalFeature(
        modality="image", mm_hash="ab" * 32, placeholder=PlaceholderRange(5, tokens), data=data
    )
    prompt = list(range(tokens + 40))
    return EngineCoreRequest("bench-1", prompt, [feature], SamplingParams(max_tokens=64))


def _check_equal(a: EngineCoreRequest, b: EngineCoreRequest) -> None:
    da, db = a.mm_features[0].data, b.mm_features[0].data
    if not (isinstance(da, dict) and isinstance(db, dict) and da.keys() == db.keys()):
        raise SystemExit("round trip lost the feature data")
    for key in da:
        if not np.array_equal(da[key], db[key]) or da[key].dtype != db[key].dtype:
            raise SystemExit(f"round trip changed {key}")
    if a.prompt_token_ids != b.prompt_token_ids:
        raise SystemExit("round trip changed the prompt")


def codec_roundtrip(msg: EngineCoreRequest) -> Any:
    return decode_request(encode_request(msg))[1]


def codec_copy_roundtrip(msg: EngineCoreRequest) -> Any:
    return decode_request([bytes(frame) for frame in encode_request(msg)])[1]


def pickle_roundtrip(msg: EngineCoreRequest) -> Any:
    return pickle.loads(pickle.dumps(msg))  # the baseline we measure against


class ZmqPair:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.tx, self.rx = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        self.rx.bind("inproc://bench-protocol")
        self.tx.connect("inproc://bench-protocol")

    def codec(self, msg: EngineCoreRequest) -> Any:
        self.tx.send_multipart(encode_request(msg), copy=False)
        return decode_request(self.rx.recv_multipart(copy=False))[1]

    def pickle(self, msg: EngineCoreRequest) -> Any:
        self.tx.send(pickle.dumps(msg), copy=False)
        return pickle.loads(self.rx.recv(copy=False).buffer)  # the baseline

    def close(self) -> None:
        self.tx.close(linger=0)
        self.rx.close(linger=0)
        self.ctx.term()


def measure(fn: Callable[[Any], Any], msg: Any, repeat: int) -> tuple[float, float]:
    """(best, median) seconds per call."""
    timer = timeit.Timer(lambda: fn(msg))
    number, _ = timer.autorange()
    runs = [t / number for t in timer.repeat(repeat=repeat, number=number)]
    return min(runs), statistics.median(runs)


def main() -> int:
    parser = argparse.ArgumentParser(description="wire codec vs pickle round trip")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--check", action="store_true", help="exit 1 if below the target")
    args = parser.parse_args()
    pair = ZmqPair()
    summary: list[str] = []
    met = True
    try:
        print(f"{'layout':8} {'path':11} {'codec ms':>9} {'pickle ms':>10} {'speed-up':>9}")
        for layout in ("clip", "qwen2vl"):
            msg = make_request(layout)
            for fn in (codec_roundtrip, codec_copy_roundtrip, pickle_roundtrip, pair.codec):
                _check_equal(msg, fn(msg))
            _check_equal(msg, pair.pickle(msg))
            rows = [
                ("in-process", codec_roundtrip, pickle_roundtrip),
                ("one copy", codec_copy_roundtrip, pickle_roundtrip),
                ("zmq inproc", pair.codec, pair.pickle),
            ]
            for path, ours, baseline in rows:
                (c_best, c_med), (p_best, p_med) = (
                    measure(ours, msg, args.repeat),
                    measure(baseline, msg, args.repeat),
                )
                ratio = p_best / c_best
                print(
                    f"{layout:8} {path:11} {c_best * 1e3:9.3f} {p_best * 1e3:10.3f} "
                    f"{ratio:8.1f}x   (medians {c_med * 1e3:.3f} / {p_med * 1e3:.3f} ms)"
                )
                summary.append(f"{layout}/{path} {ratio:.1f}x")
                if path == "in-process":
                    met = met and ratio >= TARGET
    finally:
        pair.close()
    verdict = "met" if met else "NOT met"
    print(
        "SUMMARY bench_protocol: codec vs pickle round trip of a 448x448 image request, "
        f"speed-up {', '.join(summary)}; target >= {TARGET:.0f}x in-process: {verdict}"
    )
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    raise SystemExit(main())
