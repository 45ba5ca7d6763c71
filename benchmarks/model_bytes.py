"""Bytes a decode step must read and the machine's copy bandwidth: the decode steps' bytes
roofline of ``bench_engine_medium.py`` (the memory-side twin of ``model_flops.py``).

A decode step reads every weight of the text model once (its layers, final norm and LM head;
the embedding rows it looks up are negligible, the vision tower is idle) and, per request, the
keys and values of its whole context in every layer. ``decode_bytes`` counts that from a LLaVA
``config.json``; ``copy_bandwidth`` times a large copy on the device (CUDA: device to device;
CPU: a memcpy of a large tensor), counting bytes read plus written. Their quotient is the
least time the decode steps could take: a step that takes k times that is at k x the bytes
roofline (1.0 is the memory system's limit).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any


def _text_config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return config["text_config"]


def weight_bytes(model_dir: Path, itemsize: int) -> int:
    """Bytes of the weights one decode step reads: text layers, final norm, LM head."""
    t = _text_config(model_dir)
    d, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    per_layer = 2 * d * heads * hd + 2 * d * kv * hd + 3 * d * inter + 2 * d
    return itemsize * (layers * per_layer + d + d * t["vocab_size"])


def kv_bytes_per_token(model_dir: Path, itemsize: int) -> int:
    """Bytes of one token's keys and values over every layer."""
    t = _text_config(model_dir)
    return itemsize * 2 * t["num_hidden_layers"] * t["num_key_value_heads"] * t["head_dim"]


def decode_bytes(model_dir: Path, contexts: list[int], steps: int, itemsize: int) -> float:
    """Bytes read by ``steps`` decode steps whose rows attend ``contexts`` keys in all:
    the weights once per step plus every row's KV."""
    kv = kv_bytes_per_token(model_dir, itemsize) * sum(contexts)
    return float(steps * weight_bytes(model_dir, itemsize) + kv)


def copy_bandwidth(device: str, threads: int, nbytes: int | None = None) -> tuple[float, int]:
    """Bytes/s (read + written) of copying one ``nbytes`` tensor into another on ``device``
    (median of 5 timed after 2 warm-ups; default 2 GiB on CUDA, 256 MiB on CPU);
    ``(bytes_per_s, nbytes)``."""
    import torch

    torch.set_num_threads(threads)
    if nbytes is None:
        nbytes = (2 << 30) if device == "cuda" else (256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for k in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        if k >= 2:
            times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times), nbytes
