"""Suite-wide collection rules.

- ``@pytest.mark.cuda`` tests need a CUDA device. Without one they are skipped with that
  reason, unless ``MMIS_REQUIRE_CUDA=1`` (set by ``scripts/gpu-check``, which runs them on a
  GPU machine): then a missing device is an error, so the device check cannot pass by
  skipping.
- Every engine the suite starts computes in float32 unless its test passes ``--dtype``
  (``MMIS_ENGINE_DTYPE``, read by every ``mmis engine`` / ``mmis serve`` child): the greedy
  references are float32 transformers forwards, and on a CPU with AMX/AVX512-BF16 ``--dtype
  auto`` may pick bfloat16 (``server/mmis/engine/execution/dtype.py``), whose answers differ. The
  resolution of ``auto`` itself is tested in ``tests/engine/test_engine_dtype_kv.py``.
- Every engine the suite starts runs its language-model linears on oneDNN
  (``MMIS_ENGINE_CPU_LINEAR=onednn``, ``server/mmis/engine/execution/cpu_linear.py``), not on what
  ``auto`` measures faster on the machine of the day, so the engine-process parity tests always
  hold that path to transformers; the runner-level tests (``tests/engine/test_runner_*.py``)
  load their adapters unpacked, on torch's ``F.linear``. ``auto``'s rule has its own tests
  (``tests/engine/test_cpu_linear.py``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MMIS_ENGINE_DTYPE", "float32")
os.environ.setdefault("MMIS_ENGINE_CPU_LINEAR", "onednn")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("MMIS_REQUIRE_CUDA") == "1":
        raise pytest.UsageError(
            f"MMIS_REQUIRE_CUDA=1 but torch sees no CUDA device ({len(cuda_items)} cuda tests)"
        )
    skip = pytest.mark.skip(
        reason="needs a CUDA device (none here); scripts/gpu-check runs these on a GPU machine"
    )
    for item in cuda_items:
        item.add_marker(skip)
