"""Compile time of Gemma's compiled norms (``server/mmis/engine/execution/model/compiled.py``),
cold and from inductor's on-disk cache (issue 44: a compiled layer part is acceptable if its
compile time is bounded and cached).

    rm -rf /tmp/inductor-cold; export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cold
    .venv/bin/python benchmarks/norm_compile_time.py  # cold
    .venv/bin/python benchmarks/norm_compile_time.py  # warm: from the cache

Gemma 3 4B's widths in bfloat16 (hidden 2560, head_dim 256, 8 q and 4 kv heads): a sandwich
norm on a step of 7 tokens (its first graph: every step of 2 tokens or more), of 1 token (the
second: a size of 1 is a constant of its graph) and of 300 (compiles nothing), then the joint
q/k norm at 7 and 300 tokens. Each line is the wall time of that first call; the first one
also pays dynamo's and inductor's imports.
"""

from __future__ import annotations

import time

import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from mmis.engine.execution.model.norms import FusedRMSNorm, JointQKNorm

HIDDEN, HEAD_DIM, HQ, HK = 2560, 256, 8, 4


def main() -> None:
    start = time.perf_counter()
    norm = FusedRMSNorm(Gemma3RMSNorm(HIDDEN).bfloat16(), gemma=True, compiled=True)
    attention = torch.nn.Module()
    attention.k_proj = torch.nn.Linear(1, HK * HEAD_DIM, device="meta")
    q_norm, k_norm = (
        FusedRMSNorm(Gemma3RMSNorm(HEAD_DIM).bfloat16(), gemma=True, compiled=True) for _ in "qk"
    )
    pair = JointQKNorm(q_norm, k_norm, attention)
    with torch.inference_mode():
        for tokens in (7, 1, 300):
            x = torch.randn(1, tokens, HIDDEN).bfloat16()
            t = time.perf_counter()
            norm(x)
            print(f"sandwich norm, {tokens} tokens: {time.perf_counter() - t:.2f} s")
        for tokens in (7, 300):
            qkv = torch.randn(1, tokens, (HQ + 2 * HK) * HEAD_DIM).bfloat16()
            q = qkv[..., : HQ * HEAD_DIM].view(1, tokens, HQ, HEAD_DIM).transpose(1, 2)
            t = time.perf_counter()
            pair.normalise_q(q)
            print(f"joint q/k norm, {tokens} tokens: {time.perf_counter() - t:.2f} s")
    print(f"total {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
