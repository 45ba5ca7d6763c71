"""Unit tests of ``mmis.engine.lora`` (no model): the grouped apply against a per-row
reference, the wrapper's composition with the CPU's packed linears, the resident set's LRU and
pins, and every bad-adapter case's typed error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mmis.engine.lora.adapter import load_adapter
from mmis.engine.lora.errors import (
    LoRACapacityError,
    LoRAConfigError,
    LoRAFileError,
    LoRARankError,
    LoRATargetError,
)
from mmis.engine.lora.layer import LoRALinear, LoRARows, grouped_lora_delta
from mmis.engine.lora.residency import SlotTable


def test_grouped_apply_equals_per_row_reference() -> None:
    g = torch.Generator().manual_seed(0)
    slots, rank, n_in, n_out, rows = 5, 8, 24, 40, 13
    a = torch.randn(slots, rank, n_in, generator=g)
    b_t = torch.randn(slots, rank, n_out, generator=g)
    a[0].zero_(), b_t[0].zero_()  # slot 0: no adapter
    a[3, 5:].zero_(), b_t[3, 5:].zero_()  # a rank-5 adapter, zero-padded
    x = torch.randn(rows, n_in, generator=g)
    index = [0, 1, 2, 3, 4, 0, 4, 4, 1, 3, 0, 2, 2]
    rows_ = LoRARows(slots)
    rows_.select(index, dtype=torch.float32, device="cpu")
    assert rows_.single is None and rows_.slots == {1, 2, 3, 4}
    mask = rows_.flat_mask(rank)
    assert mask.shape == (rows, slots * rank) and rows_.flat_mask(rank) is mask  # once a step
    got = grouped_lora_delta(x, a, b_t, mask)
    want = torch.stack([x[i] @ a[s].T @ b_t[s] for i, s in enumerate(index)])
    torch.testing.assert_close(got, want)
    assert torch.all(got[[0, 5, 10]] == 0)  # base rows: exactly nothing added
    # leading dims ([1, rows, in], as a language model is called) broadcast the same
    torch.testing.assert_close(grouped_lora_delta(x[None], a, b_t, mask)[0], want)


@pytest.mark.parametrize(
    "seq_slots",
    [
        [2, 0, 1, 2],  # several adapters and base rows: the grouped apply
        [2, 2, 2, 2],  # one adapter on every row: its own pair, no mask
        [0, 2, 0, 2],  # one adapter beside base rows: its pair and a 0/1 row mask
        [0, 1, 0, 1],  # only an adapter this projection does not hold: the base alone
    ],
)
def test_wrapper_row_index_per_sequence_equals_per_row_reference(seq_slots: list[int]) -> None:
    """Each sequence's slot set once for its tokens (``repeats``, as the runner calls it), over
    the three paths of ``LoRALinear.forward`` and the skip; outputs against row-by-row sums."""
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(8, 6)
    rows = LoRARows(4)
    wrapped = LoRALinear(linear, rows, max_rank=3)
    pairs = {
        s: (torch.randn(r, 8, generator=g), torch.randn(6, r, generator=g))
        for s, r in ((2, 3), (3, 2))
    }  # slot 1 holds an adapter that leaves this projection alone
    for s, (a, b) in pairs.items():
        wrapped.set_slot(s, a, b)
    if not set(seq_slots) & set(pairs):  # the skip never reads a slot this layer does not hold
        wrapped.lora_a[1].fill_(float("nan"))
    sizes = [3, 1, 4, 2]  # tokens per sequence
    x = torch.randn(1, sum(sizes), 8, generator=g)  # [1, tokens, in], as the model calls it
    rows.select(seq_slots, repeats=sizes, dtype=torch.float32, device="cpu")
    per_row = [s for s, n in zip(seq_slots, sizes, strict=True) for _ in range(n)]
    with torch.no_grad():
        want = linear(x).clone()
        for i, s in enumerate(per_row):
            if s in pairs:
                a, b = pairs[s]
                want[0, i] += x[0, i] @ a.T @ b.T
        got = wrapped(x)
    torch.testing.assert_close(got, want)
    base_rows = [i for i, s in enumerate(per_row) if s not in pairs]
    assert torch.equal(got[0, base_rows], linear(x)[0, base_rows].detach())  # exactly the base


def test_wrapper_over_a_linear_and_a_packed_linear() -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(16, 12)
    rows = LoRARows(3)
    wrapped = LoRALinear(linear, rows, max_rank=4)
    a, b = torch.randn(2, 16), torch.randn(12, 2)
    wrapped.set_slot(2, a, b)
    x = torch.randn(3, 16)
    rows.select([0, 2, 0], dtype=torch.float32, device="cpu")
    out = wrapped(x)
    torch.testing.assert_close(out[[0, 2]], linear(x)[[0, 2]])
    torch.testing.assert_close(out[1], linear(x[1]) + x[1] @ a.T @ b.T)
    rows.select([0, 0, 0], dtype=torch.float32, device="cpu")  # a base-only step
    assert rows.mask is None and torch.equal(wrapped(x), linear(x))
    from mmis.engine.execution.cpu_linear import PackedLinear

    try:
        packed = PackedLinear(linear)
        packed(x)
    except (RuntimeError, AttributeError) as exc:  # no oneDNN in this build
        pytest.skip(f"no oneDNN: {exc}")
    over_packed = LoRALinear(packed, rows, max_rank=4, dtype=torch.float32)
    over_packed.set_slot(1, a, b)
    rows.select([1, 0, 1], dtype=torch.float32, device="cpu")
    torch.testing.assert_close(over_packed(x)[0], linear(x[0]) + x[0] @ a.T @ b.T)
    torch.testing.assert_close(over_packed(x)[1], linear(x[1]))
    with pytest.raises(ValueError, match="slot 0"):
        wrapped.set_slot(0, a, b)


def test_slot_table_lru_pins_and_capacity() -> None:
    table = SlotTable(2, 3)
    assert table.acquire("a").slot == 1 and table.acquire("b").slot == 2
    assert table.acquire("a").load is False  # resident: no reload, pinned twice
    assert not table.can_run(["c"])  # both slots pinned
    with pytest.raises(LoRACapacityError, match="slots are in use"):
        table.acquire("c")
    assert table.resident() == {"a": 1, "b": 2}  # a refusal changes nothing
    table.release("b")
    assert table.can_run(["a", "c"]) and not table.can_run(["a", "b", "c"])
    got = table.acquire("c")
    assert got == type(got)(slot=2, load=True, evicted="b")
    with pytest.raises(ValueError, match="in use"):
        table.drop("a")
    table.release("a"), table.release("a")
    assert table.drop("a") == 1 and table.acquire("d").slot == 1
    assert [table.touch_host(n) for n in "wxyz"] == [[], [], [], ["w"]]
    with pytest.raises(ValueError, match="at least --max-loras"):
        SlotTable(4, 2)


MODULES = {"model.language_model.layers.0.self_attn.q_proj": (8, 8), "model.visual.qkv": (8, 24)}


def _adapter(
    path: Path,
    *,
    rank: int = 4,
    config: dict[str, object] | None = None,
    module: str = "model.language_model.layers.0.self_attn.q_proj",
    shape: tuple[int, int] = (8, 8),
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    prefix = f"base_model.model.{module}"
    weights = {
        f"{prefix}.lora_A.weight": torch.ones(rank, shape[0]),
        f"{prefix}.lora_B.weight": torch.ones(shape[1], rank),
    }
    save_file(weights, str(path / "adapter_model.safetensors"))
    return path


def test_adapter_loads_scaling_and_rslora(tmp_path: Path) -> None:
    plain = load_adapter("p", 1, str(_adapter(tmp_path / "p")), MODULES, 8)
    assert plain.scaling == 2.0 and plain.rank == 4
    (a, b) = plain.weights["model.language_model.layers.0.self_attn.q_proj"]
    assert torch.all(b == 2.0) and a.shape == (4, 8)
    rs = load_adapter(
        "r", 2, str(_adapter(tmp_path / "r", config={"use_rslora": True})), MODULES, 8
    )
    assert rs.scaling == 4.0  # alpha / sqrt(r)
    assert not plain.touches(("model.visual",))
    tower = _adapter(tmp_path / "t", module="model.visual.qkv", shape=(8, 24))
    assert load_adapter("t", 3, str(tower), MODULES, 8).touches(("model.visual",))


def test_unreadable_weights_name_the_permission_not_a_missing_file() -> None:
    """safetensors reports a file it may not open as "No such file or directory" (a pod's
    uid 1000 and a 0600 file written by another user: tests/kube/test_realnode_mmis.py); the
    error says it is unreadable and how to fix it. Root reads anything, so the read runs in a
    forked child that drops to uid 65534 first."""
    import os
    import tempfile

    # pytest's own tmp_path sits under a 0700 directory the child's uid cannot enter
    scratch = Path(tempfile.mkdtemp(prefix="mmis-lora-perm-"))
    scratch.chmod(0o755)
    path = _adapter(scratch / "a")
    path.chmod(0o755)
    (path / "adapter_config.json").chmod(0o644)
    (path / "adapter_model.safetensors").chmod(0o600)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        message = "no error"
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            load_adapter("mine", 1, str(path), MODULES, 8)
        except LoRAFileError as exc:
            message = str(exc)
        except BaseException as exc:  # anything else is the failure reported
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    import shutil

    shutil.rmtree(scratch)
    assert "is not readable by this process (uid" in message, message
    assert "chmod a+r" in message and "No such file" not in message


@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("no directory", LoRAFileError, "is not a directory"),
        ("no config", LoRAFileError, "adapter_config.json does not exist"),
        ("bad json", LoRAFileError, "cannot read"),
        ("no weights", LoRAFileError, "adapter_model.safetensors does not exist"),
        ("corrupt weights", LoRAFileError, "cannot read"),
        ("rank over the limit", LoRARankError, "rank 16 exceeds --max-lora-rank 8"),
        ("dora", LoRAConfigError, "DoRA"),
        ("unknown target", LoRATargetError, "match no projection"),
        ("module the model lacks", LoRATargetError, "no LoRA-capable projection"),
        ("wrong shape", LoRATargetError, "8->8 in the model"),
    ],
)
def test_each_bad_adapter_raises_its_typed_error(
    tmp_path: Path, case: str, error: type[Exception], words: str
) -> None:
    path = tmp_path / "a"
    if case != "no directory":
        _adapter(path)
    if case == "no config":
        (path / "adapter_config.json").unlink()
    elif case == "bad json":
        (path / "adapter_config.json").write_text("{not json")
    elif case == "no weights":
        (path / "adapter_model.safetensors").unlink()
    elif case == "corrupt weights":
        (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    elif case == "rank over the limit":
        _adapter(path, rank=16)
    elif case == "dora":
        _adapter(path, config={"use_dora": True})
    elif case == "unknown target":
        _adapter(path, config={"target_modules": ["q_proj", "nonexistent_proj"]})
    elif case == "module the model lacks":
        _adapter(path, module="model.language_model.layers.7.self_attn.q_proj")
    elif case == "wrong shape":
        _adapter(path, shape=(8, 16))
    with pytest.raises(error, match=words) as info:
        load_adapter("mine", 1, str(path), MODULES, 8)
    assert "'mine'" in str(info.value)  # names the adapter


def test_lora_settings_refused_where_they_cannot_work() -> None:
    from mmis.config import ConfigError
    from mmis.engine.config import EngineConfig

    assert EngineConfig().enable_lora is False  # off by default
    EngineConfig(enable_lora=True, tensor_parallel_size=2)  # split as the linears: test_lora_tp
    with pytest.raises(ConfigError, match="--max-cpu-loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
