"""Model FLOPs of a benchmark run and the machine's matmul yardstick (``bench_engine_medium.py``).

``model_flops`` counts a whole run and ``decode_flops`` the decode rows of single steps, from a
LLaVA ``config.json`` (2 FLOPs per multiply-add, matmuls only);
``matmul_peak`` times a square matmul in the run's dtype, device and threads, so a run's
model FLOP/s can be read as a share of what the machine reached in the same run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _text_costs(t: dict[str, Any]) -> tuple[int, int, int]:
    """FLOPs of one token through the text layers, per key it attends to, and of its LM-head
    row, from a ``text_config``."""
    d, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    per_token = 2 * layers * (d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * inter)
    return per_token, 2 * 2 * layers * heads * hd, 2 * d * t["vocab_size"]


def decode_flops(model_dir: Path, contexts: list[int]) -> float:
    """Matmul FLOPs of decode rows whose contexts (keys attended, the new token included) are
    ``contexts``: the text layers, attention over each context and the LM head per row."""
    t = json.loads((model_dir / "config.json").read_text())["text_config"]
    per_token, per_key, head = _text_costs(t)
    return float(sum(per_token + per_key * c + head for c in contexts))


def model_flops(model_dir: Path, prompt_lens: list[int], tokens: int) -> float:
    """Matmul FLOPs of the engine's whole run (2 per multiply-add): every prompt and output
    token through the text layers with causal attention over its context, the LM head for
    output tokens only (the engine scores only sampled rows), one vision tower + projector
    pass per image (one per request). Elementwise work and norms are not counted."""
    config = json.loads((model_dir / "config.json").read_text())
    t, v = config["text_config"], config["vision_config"]
    d = t["hidden_size"]
    per_token, attn_per_context, head = _text_costs(t)  # attention: QK^T and AV, per key
    dv, iv, lv = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"]
    patches = (v["image_size"] // v["patch_size"]) ** 2 + 1
    vision = 2 * lv * patches * (4 * dv * dv + 2 * dv * iv) + 4 * lv * patches * patches * dv
    vision += 2 * (patches - 1) * (dv * d + d * d)  # the projector, on the kept patches
    total = 0.0
    for length in prompt_lens:
        n = length + tokens
        total += n * per_token + attn_per_context * n * (n + 1) / 2
        total += tokens * head + vision
    return total


def matmul_peak(device: str, threads: int, dtype: Any) -> tuple[float, int]:
    """FLOP/s of a square matmul in the benchmark's dtype on ``device`` (median of 5 timed
    after 2 warm-ups): the yardstick for the model FLOP/s; ``(flops, n)``."""
    import statistics

    import torch

    torch.set_num_threads(threads)
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    times = []
    for k in range(7):
        _sync(torch, device)
        start = time.perf_counter()
        a @ b
        _sync(torch, device)
        if k >= 2:
            times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times), n
