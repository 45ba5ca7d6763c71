"""The picker's Go side of the event streams (router/pkg/events) against this repository's
encoder (server/mmis/protocol/kv_events.py, itself checked byte-for-byte against vLLM's in
tests/engine/test_kv_events.py).

- the golden batches the Go tests decode are exactly what the Python encoder writes today;
- the Go unit tests (``go test ./...`` in router/) pass: the decoder's bounds and its fuzz
  seeds, the frame cap, the panic rule, PLAIN against libzmq (through this interpreter's
  pyzmq, ``MMIS_PYTHON``), the scorer, pods and keys; under ``CI=true`` a missing Go
  toolchain fails the test instead of skipping it. (The fuzzers themselves run for a bounded
  time in ``tests/security/test_picker_hostile.py``.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from mmis.protocol import kv_events as k

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tools.py
from tools import in_ci

ROUTER = Path(__file__).resolve().parents[2] / "router"
GOLDEN = ROUTER / "pkg" / "events" / "testdata"

pytestmark = pytest.mark.routing


def golden_batches() -> dict[str, bytes]:
    """The batches router/pkg/events/batch_test.go decodes (regenerate the files from here)."""
    kv = k.KVEventBatch(
        ts=1.5,
        events=[
            k.AllBlocksCleared(),
            k.BlockStored(
                block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None,
                token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU",
                lora_name=None, extra_keys=[("abc", 0), None],
            ),
            k.BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU"),
            k.BlockStored(
                block_hashes=[7], parent_block_hash=None, token_ids=list(range(16)),
                block_size=16, lora_id=None, medium=None, lora_name=None,
            ),
        ],
    )  # fmt: skip
    mm = k.MMEventBatch(
        ts=2.0,
        events=[
            k.EpochStarted(epoch="e1"),
            k.MMItemStored(mm_hash="h1", nbytes=10),
            k.MMItemEvicted(mm_hash="h1"),
            k.MMItemStored(mm_hash="h2", nbytes=3),
        ],
    )
    enc = msgspec.msgpack.encode
    return {"kv_batch.msgpack": enc(kv), "mm_batch.msgpack": enc(mm)}


def test_golden_batches_are_what_the_encoder_writes() -> None:
    for name, data in golden_batches().items():
        assert (GOLDEN / name).read_bytes() == data, f"{name} is stale: regenerate it from here"


def _go() -> str | None:
    return shutil.which("go") or next(
        (p for p in ("/usr/local/go/bin/go",) if Path(p).is_file()), None
    )


def test_go_unit_tests_pass() -> None:
    go = _go()
    if go is None:
        if in_ci():
            pytest.fail("Go is not installed (CI=true): install Go >= 1.26", pytrace=False)
        pytest.skip("Go is not installed; install Go >= 1.26 to run router/'s tests")
    cache = Path(os.environ.get("MMIS_GO_CACHE", Path.home() / ".cache" / "mmis" / "go"))
    env = {
        **os.environ,
        "GOMODCACHE": str(cache / "mod"),
        "GOCACHE": str(cache / "build"),
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
        "GOFLAGS": "-mod=readonly",
        "MMIS_PYTHON": sys.executable,  # plain_test.go's libzmq PLAIN server (pyzmq)
    }
    proc = subprocess.run(
        [go, "test", "./..."], cwd=ROUTER, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
