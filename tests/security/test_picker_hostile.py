"""Issue 41, item 3: five hostile bytes killed the picker.

What an attacker did: the picker (``router/``, ``mmis-epp``) connects to every pod of its
InferencePool and decodes whatever the pod's event sockets send. The batch ``dd 04 00 00 00``
(an array claiming 67M elements) took the process to 1.58 GB, over its 1 Gi limit; 2 MB of
nested arrays overflowed its stack; a ZMTP frame header claiming 2^40 bytes made go-zeromq
allocate what it claimed. There is one picker, so the pool's routing stopped with it. A pod in
the pool (or anyone who answers on its address) only has to accept the picker's connection —
with the internal token the picker presents its password to whoever answers, so a hostile
"engine" here welcomes any PLAIN credentials — and send those bytes.

The fix (docs/ROUTING.md, "The picker"; docs/SECURITY.md): a bounded msgpack decoder, ZMTP
frames capped on the connection before go-zeromq reads them, a panic in a stream's goroutine
dropping that stream instead of the process. Checked here:

- ``test_go_fuzz_finds_no_crash``: the Go fuzz targets (``FuzzDecode``: the batch decoder;
  ``FuzzStream``: bytes from an engine's socket through the frame-capping connection,
  go-zeromq, the stream's parsing, the decoder and an index) run for ``FUZZ_SECONDS`` each from
  their seed corpora (``router/pkg/events/testdata/fuzz/``: the golden batches and the inputs
  above) and find no crash. Under ``CI=true`` a missing Go fails the test.
- ``test_the_picker_survives_a_hostile_engine``: the real ``mmis-epp`` in the loop
  (``tests/kube/picker_stack.py``: ``mmis serve`` replicas selected by an ``InferencePool`` in
  the test control plane, ``mmis-gateway`` in front). The third replica's event ports are
  taken by a hostile engine (:class:`HostileEngine`) that answers every connection with one of
  the inputs above, in turn, while its HTTP API stays a real ``mmis serve``. Every hostile
  input reaches the picker on both stream kinds while requests go on; the picker keeps its pid,
  its RSS stays under ``RSS_BOUND``, every request through the gateway is a 200, the hostile
  pod's streams are distrusted and the good pods' (PLAIN, with the stack's internal token)
  are followed and fill. The picker built from the router before the fix died here within
  seconds ("fatal error: runtime: out of memory": a 1 TiB make in go-zeromq's frame reader),
  and the gateway answered 503.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kube"))
from kubecluster import Cluster, ToolsMissing, find_tools
from picker_stack import PickerStack
from procs import image_url
from tools import go_tool, in_ci

from mmis_operator.routing import EventPorts

ROOT = Path(__file__).resolve().parents[2]
ROUTER = ROOT / "router"
FUZZ_SECONDS = 10  # a CI smoke from the seed corpora; `go test -fuzz` runs longer by hand
RSS_BOUND = 512 << 20  # bytes; the picker idles near 60-100 MiB, the old one reached 1.58 GB
HOSTILE_IP = "127.0.0.4"  # the third replica's address: its event ports are the attacker's

# ----------------------------------------------------------------------------- Go fuzzing


def _go_env() -> tuple[str, dict[str, str]]:
    go = shutil.which("go") or next(
        (p for p in ("/usr/local/go/bin/go",) if Path(p).is_file()), None
    )
    if go is None:
        if in_ci():
            pytest.fail("Go is not installed (CI=true): install Go >= 1.26", pytrace=False)
        pytest.skip("Go is not installed; install Go >= 1.26 to fuzz router/")
    cache = Path(os.environ.get("MMIS_GO_CACHE", Path.home() / ".cache" / "mmis" / "go"))
    env = {
        **os.environ,
        "GOMODCACHE": str(cache / "mod"),
        "GOCACHE": str(cache / "build"),
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
        "GOFLAGS": "-mod=readonly",
        "MMIS_PYTHON": sys.executable,
    }
    return go, env


@pytest.mark.routing
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", ["FuzzDecode", "FuzzStream"])
def test_go_fuzz_finds_no_crash(target: str) -> None:
    go, env = _go_env()
    workers = str(min(4, os.cpu_count() or 1))
    cmd = [go, "test", "-run=^$", f"-fuzz=^{target}$", f"-fuzztime={FUZZ_SECONDS}s"]
    cmd += ["-parallel", workers, "./pkg/events"]
    proc = subprocess.run(cmd, cwd=ROUTER, env=env, capture_output=True, text=True, timeout=840)
    out = proc.stdout + proc.stderr
    # a crash makes Go save the input under testdata/fuzz/<target>/ and name it in the output
    assert proc.returncode == 0, f"{target} found a crash (rc {proc.returncode}):\n{out[-4000:]}"
    assert "fuzz: elapsed" in out, f"{target} did not fuzz:\n{out[-2000:]}"


# ----------------------------------------------------------------------------- the hostile engine


def _frame(body: bytes, more: bool = False) -> bytes:
    flags = 0x01 if more else 0
    if len(body) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _message(*frames: bytes) -> bytes:
    return b"".join(_frame(f, i < len(frames) - 1) for i, f in enumerate(frames))


def _command(name: bytes, body: bytes = b"") -> bytes:
    data = bytes([len(name)]) + name + body
    if len(data) > 255:
        return b"\x06" + struct.pack(">Q", len(data)) + data
    return bytes([0x04, len(data)]) + data


def _greeting(mechanism: bytes) -> bytes:
    g = bytearray(64)
    g[0], g[9], g[10], g[11] = 0xFF, 0x7F, 3, 0
    g[12 : 12 + len(mechanism)] = mechanism
    g[32] = 1  # as-server
    return bytes(g)


def _ready(socket_type: bytes) -> bytes:
    name = b"Socket-Type"
    return _command(
        b"READY", bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type
    )


# What the old picker died of, and their kin. A PUB message is (topic, seq, payload); a replay
# answer is (empty, topic, seq, payload).
SEQ = struct.pack(">Q", 0)
HOSTILE: dict[str, tuple[bytes, bytes]] = {
    "a frame claiming 2^40 bytes": (b"\x02" + struct.pack(">Q", 1 << 40),) * 2,
    "an array claiming 67M elements": (
        _message(b"", SEQ, b"\xdd\x04\x00\x00\x00"),
        _message(b"", b"", SEQ, b"\xdd\x04\x00\x00\x00"),
    ),
    "2 MB of nested arrays": (
        _message(b"", SEQ, b"\x91" * (2 << 20)),
        _message(b"", b"", SEQ, b"\x91" * (2 << 20)),
    ),
    "endless MORE frames": (_frame(b"x", more=True) * 200_000,) * 2,
    "garbage": (bytes(range(256)) * 64,) * 2,
}


class HostileEngine:
    """Raw TCP listeners on ``ip`` at the four event ports. To every connection: a greeting
    with the mechanism the picker asked for (PLAIN's credentials are welcomed, whatever they
    are), READY, then the next of :data:`HOSTILE`, in turn per socket. ``served`` counts what
    was sent, by ``(kind, "pub" | "replay")``."""

    def __init__(self, ip: str, ports: EventPorts) -> None:
        self.served: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listeners: list[socket.socket] = []
        for port, role in ((ports.kv, "pub"), (ports.kv_replay, "replay"),
                           (ports.mm, "pub"), (ports.mm_replay, "replay")):  # fmt: skip
            sock = socket.create_server((ip, port))
            sock.settimeout(0.2)
            self._listeners.append(sock)
            threading.Thread(target=self._accept, args=(sock, role), daemon=True).start()

    def _accept(self, listener: socket.socket, role: str) -> None:
        turn = 0
        kinds = list(HOSTILE)
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            kind = kinds[turn % len(kinds)]
            turn += 1
            threading.Thread(target=self._serve, args=(conn, role, kind), daemon=True).start()

    def _serve(self, conn: socket.socket, role: str, kind: str) -> None:
        with conn:
            conn.settimeout(5)
            try:
                peer = b""
                while len(peer) < 64:
                    chunk = conn.recv(64 - len(peer))
                    if not chunk:
                        return
                    peer += chunk
                mechanism = peer[12:32].rstrip(b"\0")
                hello = _greeting(mechanism)
                if mechanism == b"PLAIN":
                    hello += _command(b"WELCOME")  # anyone is welcome here
                hello += _ready(b"PUB" if role == "pub" else b"ROUTER")
                conn.sendall(hello + HOSTILE[kind][0 if role == "pub" else 1])
                with self._lock:
                    self.served[(kind, role)] += 1
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline and conn.recv(65536):
                    pass  # what the picker says is read and dropped until it hangs up
            except OSError:
                return

    def covered(self) -> bool:
        """Every hostile input has been sent on both a PUB and a replay socket."""
        with self._lock:
            return all(self.served[(k, r)] > 0 for k in HOSTILE for r in ("pub", "replay"))

    def stop(self) -> None:
        self._stop.set()
        for sock in self._listeners:
            sock.close()


class HostileStack(PickerStack):
    """The routing tests' stack, its third replica's engine publishing on decoy ports so the
    hostile engine can hold the ports the picker connects to on that address."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, replicas=3, **kwargs)
        self.hostile = HostileEngine(HOSTILE_IP, self.events)
        decoys = sorted({*_free_ports(4)})
        self._decoy = EventPorts(
            kv=decoys[0], kv_replay=decoys[1], mm=decoys[2], mm_replay=decoys[3]
        )

    def _start_replica(self, ip: str, i: int) -> None:
        if ip != HOSTILE_IP:
            super()._start_replica(ip, i)
            return
        real: EventPorts = self.events
        self.events = self._decoy  # this replica's engine publishes where nobody listens
        try:
            super()._start_replica(ip, i)
        finally:
            self.events = real

    def stop(self) -> None:
        self.hostile.stop()
        super().stop()


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.add(s.getsockname()[1])
    return sorted(ports)


def _rss(pid: int) -> int:
    """The resident set of ``pid`` in bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class _ClusterComing:
    """The control plane while it starts in a thread: :class:`PickerStack` first reaches it
    (``kubectl``, ``kubeconfig``) when it creates the pool, right after launching its replicas,
    so the control plane comes up while they load instead of before them (the setup was the
    two starts' sum)."""

    def __init__(self, started: Future[Cluster]) -> None:
        self._started = started

    def __getattr__(self, name: str) -> Any:
        return getattr(self._started.result(timeout=300), name)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    """The test control plane (as tests/kube's fixture: fails under CI=true, else skips,
    when its tools are missing), started side by side with the stack's replicas."""
    try:
        tools = find_tools(build=False)
    except ToolsMissing as exc:
        if in_ci():
            pytest.fail(f"control plane unavailable with CI=true: {exc}", pytrace=False)
        pytest.skip(f"control plane unavailable: {exc}")
    epp, gateway = go_tool("mmis-epp"), go_tool("mmis-gateway")
    namespace = "hostile-" + os.urandom(4).hex()
    with contextlib.ExitStack() as exits:

        def start() -> Cluster:
            cluster = exits.enter_context(Cluster(tools))  # stopped last, whatever happened
            cluster.kubectl("create", "namespace", namespace)
            return cluster

        with ThreadPoolExecutor(1) as pool:  # left only once the start ended, either way
            started = pool.submit(start)
            try:
                with HostileStack(
                    _ClusterComing(started),  # type: ignore[arg-type]
                    namespace,
                    tmp_path_factory.mktemp("hostile"),
                    epp,
                    gateway,
                ) as running:
                    yield running
            finally:
                if started.done() and started.exception() is None:
                    started.result().kubectl("delete", "namespace", namespace, "--wait=false")


def _chat(i: int) -> dict[str, object]:
    color = ((37 * i) % 256, (101 * i + 50) % 256, (197 * i + 90) % 256)
    return {
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url(color)}},
                    {"type": "text", "text": f"What is in picture {i}?"},
                ],
            }
        ],
    }


@pytest.mark.controlplane
@pytest.mark.routing
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_picker_survives_a_hostile_engine(stack: HostileStack) -> None:
    epp = stack.epp
    pid = epp.popen.pid
    peak = _rss(pid)
    went: Counter[str] = Counter()
    i = 0
    deadline = time.monotonic() + 180
    # requests go on until every hostile input has reached the picker on both socket kinds
    # (it reconnects at every probe, once a second), and for at least 30 requests
    while i < 30 or not stack.hostile.covered():
        assert time.monotonic() < deadline, (
            f"not every hostile input was read: {stack.hostile.served}"
        )
        dest, _ = stack.chat(_chat(i))  # raises unless 200
        went[dest] += 1
        i += 1
        assert epp.popen.poll() is None, f"the picker died:\n{epp.log_tail(40)}"
        peak = max(peak, _rss(pid))
    for _ in range(10):  # and after the last of them
        stack.chat(_chat(i))
        i += 1
        peak = max(peak, _rss(pid))
    assert epp.popen.poll() is None and epp.popen.pid == pid, "the picker was replaced"
    assert peak < RSS_BOUND, f"the picker's RSS reached {peak >> 20} MiB"
    for stream in ("kv", "mm"):
        stack.wait_metric(
            f"the hostile pod's {stream} stream distrusted", "mmis_picker_stream_live",
            lambda v: v == 0, 30, pod=HOSTILE_IP, stream=stream,
        )  # fmt: skip
    for good in ("127.0.0.2", "127.0.0.3"):
        stack.wait_metric(
            f"{good} followed",
            "mmis_picker_stream_live",
            lambda v: v == 1,
            30,
            pod=good,
            stream="kv",
        )
    blocks = sum(
        stack.picker_metric("mmis_picker_index_blocks", pod=g) or 0
        for g in ("127.0.0.2", "127.0.0.3")
    )
    assert blocks > 0, "the good pods' indexes stayed empty"
    log = epp.log_path.read_text(errors="replace")
    assert "zmtp:" in log or "malformed" in log, "the picker never logged refusing hostile bytes"
    print(f"{i} requests, all 200, by replica {dict(went)}; picker RSS peak {peak >> 20} MiB; "
          f"hostile inputs served {dict(stack.hostile.served)}")  # fmt: skip
