"""Time to first token of a 1920x1080 photo: ``mmis serve`` vs plain transformers ``generate()``.

Issue 10's benchmark. The model is the tiny Qwen2-VL with the hub's real image settings
(``mmis tiny-model --family qwen2-vl-hub``: patch 14, merge 2, max_pixels 12845056, 32768
context), so the photo becomes ~2.7k placeholder tokens: more than one prefill chunk.

- mmis: a real ``mmis serve`` process with no tuning flags; TTFT is measured by the client from
  sending a streamed chat request (the JPEG as a data URL) to its first content chunk. Each
  round uses a new photo (no encoder/prefix cache hit) and ``--rounds`` are run after one
  warm-up request; the two sides alternate request by request, so both see the same load.
- transformers: in this process, the same decoded image and chat template through the model's
  processor and ``generate(max_new_tokens=1, do_sample=False)``; timed from the JPEG bytes
  (decode + processor + prefill + first token), which is what the server's TTFT covers too
  (minus HTTP). Same thread count for both (``--threads``).

Prints one JSON line; record it in benchmarks/README.md with the ``uptime`` load.

    .venv/bin/python benchmarks/bench_photo_ttft.py --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_client import ServerProcess

PROMPT = "What is in the picture?"


def photo_jpeg(seed: int, width: int = 1920, height: int = 1080) -> bytes:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 255, (height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def mmis_ttft(root_url: str, jpeg: bytes) -> float:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    body = {
        "model": "q",
        "stream": True,
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
    }
    start = time.perf_counter()
    with httpx.stream("POST", root_url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a content chunk")


def transformers_ttft(model: Path, jpeg: bytes, loaded: tuple[object, object]) -> float:
    import torch

    processor, hf = loaded
    start = time.perf_counter()
    image = Image.open(io.BytesIO(jpeg)).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=[text], images=[image], return_tensors="pt")  # type: ignore[operator]
    with torch.no_grad():
        hf.generate(**inputs, max_new_tokens=1, do_sample=False)  # type: ignore[attr-defined]
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed requests per side")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmis.tiny_models.tiny_model import tiny_model_dir

    torch.set_num_threads(args.threads)
    model = tiny_model_dir("qwen2-vl-hub")
    loaded = (
        AutoProcessor.from_pretrained(model),
        AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval(),
    )
    env = {"OMP_NUM_THREADS": str(args.threads)}
    hf_times: list[float] = []
    mmis_times: list[float] = []
    with tempfile.TemporaryDirectory() as logs:
        serve_args = ["--model", str(model), "--served-model-name", "q"]
        server = ServerProcess.mmis_serve("photo-ttft", serve_args, Path(logs), env)
        try:
            server.wait_http("/ready", 600)
            for i in range(args.rounds + 1):  # interleaved: both sides see the same load
                hf_times.append(transformers_ttft(model, photo_jpeg(1000 + i), loaded))
                mmis_times.append(mmis_ttft(server.root_url, photo_jpeg(i)))
        finally:
            server.stop()
    mmis_p50 = statistics.median(mmis_times[1:])
    hf_p50 = statistics.median(hf_times[1:])
    print(
        json.dumps(
            {
                "photo": "1920x1080 JPEG",
                "rounds": args.rounds,
                "mmis_ttft_s": [round(t, 3) for t in mmis_times[1:]],
                "transformers_ttft_s": [round(t, 3) for t in hf_times[1:]],
                "mmis_p50_s": round(mmis_p50, 3),
                "transformers_p50_s": round(hf_p50, 3),
                "ttft_ratio_mmis_over_transformers": round(mmis_p50 / hf_p50, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
