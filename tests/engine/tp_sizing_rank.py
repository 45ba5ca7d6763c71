"""One rank of ``test_kv_sizing.py``'s two-process KV sizing, run as a script:

    python tp_sizing_rank.py RANK PORT MODEL_DIR READINGS_JSON

Both ranks load the tiny checkpoint on CPU, split it (``engine/execution/tensor_parallel.py``) and
join a gloo group; rank 0 runs ``kv_sizing.gpu_kv_blocks`` under tensor parallelism and sends the
pool size, rank 1 runs ``worker_pool_size``. Every profiling step is a real forward on both
ranks; only the memory readings are scripted (:class:`ScriptedMemory`: CPU devices have no
allocator statistics), in units of this rank's KV block bytes. Prints a JSON line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from mmis.engine.execution.attn_backends import select_backend
from mmis.engine.execution.kv_sizing import gpu_kv_blocks
from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.tensor_parallel import (
    TensorParallel,
    WorkerRank,
    init_group,
    shard_adapter,
    worker_pool_size,
)

BLOCK = 16


class ScriptedMemory:
    """A device whose readings are given: ``used`` and ``total``, and one peak per profiling
    step in turn; each step's forward really runs."""

    def __init__(self, used: int, total: int, peaks: list[int]) -> None:
        self.used, self.total, self.peaks = used, total, peaks
        self.steps = 0

    def peak_of(self, run: Callable[[], object]) -> int:
        run()
        self.steps += 1
        return self.peaks[self.steps - 1]

    def used_and_total(self) -> tuple[int, int]:
        return self.used, self.total


def main() -> None:
    rank, port, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    readings = json.loads(sys.argv[4])
    cpu = torch.device("cpu")
    adapter = load_adapter(model_dir, cpu, torch.float32)
    shard_adapter(adapter, rank, 2)
    init_group(cpu, rank, 2, port)
    unit = adapter.kv_cache_spec(BLOCK).bytes_per_block
    memory = ScriptedMemory(
        readings["used"] * unit, readings["total"] * unit, [p * unit for p in readings["peaks"]]
    )
    out: dict[str, int] = {}
    if rank == 0:
        tp = TensorParallel(2, cpu, [])
        blocks, budget, tokens = gpu_kv_blocks(
            adapter,
            readings["fraction"],
            block_size=BLOCK,
            max_num_batched_tokens=None,
            max_num_seqs=None,
            max_model_len=512,
            tp=tp,
            memory=memory,
        )
        tp.send_pool_size(blocks)
        out = {"blocks": blocks, "budget_blocks": budget // unit, "tokens": tokens}
    else:
        worker = WorkerRank(adapter, select_backend(cpu, BLOCK), BLOCK, torch.float32, cpu)
        out = {"blocks": worker_pool_size(worker, memory)}
    out["steps"] = memory.steps
    print(json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
