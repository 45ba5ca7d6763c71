"""The scheduler, KV and encoder cache managers import and run with torch blocked."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers", "torchvision"):
                raise ImportError(f"blocked import of {name}")
            return None

    sys.modules["torch"] = None
    sys.meta_path.insert(0, Block())

    from mmis.engine.scheduling.request import Request
    from mmis.engine.scheduling.sched_config import SchedulerConfig
    from mmis.engine.scheduling.scheduler import Scheduler
    from mmis.protocol.messages import MultiModalFeature, PlaceholderRange, SamplingParams

    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_num_batched_tokens=8))
    img = MultiModalFeature(modality="image", mm_hash="h", placeholder=PlaceholderRange(2, 4))
    sched.add_request(Request("r", [1, 2, 7, 7, 7, 7, 3], mm_features=[img],
                              sampling_params=SamplingParams(max_tokens=3)))
    outputs, encoded = [], []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        encoded += [s.mm_items[i].mm_hash for s in out.scheduled for i in s.encoder_inputs]
        sampled = [50 for s in out.scheduled if s.sample]
        for ev in sched.update_from_output(out, sampled):
            outputs += ev.new_token_ids
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
                    and sys.modules[m] is not None)
    print(json.dumps({"outputs": outputs, "encoded": encoded, "loaded": loaded}))
    """
)


def test_scheduler_runs_with_torch_blocked():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"outputs": [50, 50, 50], "encoded": ["h"], "loaded": []}


def test_the_block_really_blocks_torch():
    # guard against a vacuous pass: the same prologue makes `import torch` fail
    child = CHILD.split("from mmis")[0] + "import torch\n"
    proc = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode != 0 and "torch" in proc.stderr
