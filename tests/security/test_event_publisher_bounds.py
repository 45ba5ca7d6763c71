"""Issue 41, items 3 and 4: the engine's memory was anyone's through its event sockets.

What an attacker did: 400 DEALER sockets each asked the replay ROUTER for everything from
sequence 0 and never read. The replay thread pushed the whole 10,000-batch buffer at each of
them (a per-peer queue of up to 1,000 messages, beyond what the kernel buffers); the engine
went from 1.26 to 1.76 GB and did not give the memory back after they left. The live PUB
queued up to 100,000 messages per subscriber that does not read.

The bound (``engine/event_publisher.py``): at most ``MAX_REPLAYS`` (4) replays run and
``MAX_QUEUED_REPLAYS`` (16) wait, further requests are dropped; a replay sends only while its
peer reads, at most ``REPLAY_PEER_HWM`` (32) batches queued per peer, and is abandoned after
``REPLAY_STALL_S`` (3 s) without progress; the kernel keeps at most ``SOCKET_SNDBUF`` per
connection (not in RSS). So ``connected`` peers of which ``served`` got a replay cost the
engine at most ``served * REPLAY_PEER_HWM * (largest batch + 5 * 64) + connected *
CONNECTION_BYTES + SLACK`` bytes (:func:`peer_bound`), with ``CONNECTION_BYTES`` = 64 KiB
(libzmq's per connection: two 8 KiB batch buffers, two pipes' first 256-message chunks of
64-byte message headers, session and PLAIN objects; 5 * 64: the five frames' headers) and
``SLACK`` = 32 MiB (the allocator, a thread's arena, Python). Within ``t`` seconds at most
``MAX_REPLAYS + MAX_QUEUED_REPLAYS + MAX_REPLAYS * ceil(t / REPLAY_STALL_S)`` peers are
served (:func:`most_served`: 36 in this test's 9 s and a poll), and however long they stay,
never more than all of them: with this test's largest batch (about 17 KiB: a 4,000-token
prompt's 250 block hashes stored and as many evicted, in one step) the bound asserted is about
76 MiB for 400 peers over 9 s, and 270 MiB were all 400 served. Measured (2 cores, shared),
with 200 batches over 15 s: +21 MiB after the fix; +716 MiB with the replay loop before it
(every peer served at once, each holding what the kernel did not take of the 3.2 MiB buffer),
the issue's +500 MB; with this test's 1.7 MB buffer that loop would hold about 1.4 MB a peer,
over 500 MiB.

Here a real ``mmis serve`` with the events token (so the peers authenticate: the worst
case, a peer holding the token) fills its replay buffer with 100 batches from 100
completions (about 1.7 MB: twice what a peer that never reads can be sent before its replay
stalls, ``REPLAY_PEER_HWM`` batches and the kernel's buffers, so every replay stalls; a
replay that did not would end at once and free its place, and ``served`` would pass the
cap), then 400 authenticated peers ask for a replay from 0 and never read. The
engine process's RSS (``/proc``) stays within the bound, no more peers than the caps allow
receive anything, and once they leave a reading replay gets the whole buffer and the server
still answers. A unit test checks the buffer's byte bound, and one with a publisher in this
process that stalled replays neither stop a reading one nor run beyond the caps, and one
that a live subscriber that does not read holds at most ``LIVE_HWM`` batches.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import Proc, children
from tools import free_port

from mmis.engine import event_publisher as ep
from mmis.engine.event_auth import secure_client
from mmis.engine.event_publisher import END_SEQ, EventPublisher
from mmis.protocol.kv_events import KV_DECODER, BlockRemoved, BlockStored
from mmis.tiny_models.tiny_model import tiny_model_dir

TOKEN = "5e" * 32
PEERS = 400
REQUESTS = 100  # completions, one KV batch each (200 before: the same proof, 2x the fill)
PROMPT_TOKENS = 4000  # one prefill step (--max-num-batched-tokens 4096): one large batch
OBSERVE_S = 9.0  # how long the peers sit on their requests while RSS is sampled: three
# REPLAY_STALL_S turns of abandon-and-start (15 s, five turns, before: each turn is the same)
# the caps the stated bound is derived from (engine/event_publisher.py may only be tighter)
LIVE_HWM = 256
REPLAY_PEER_HWM = 32
MAX_REPLAYS = 4
MAX_QUEUED_REPLAYS = 16
REPLAY_STALL_S = 3.0
SOCKET_SNDBUF = 128 << 10
CONNECTION_BYTES = 64 << 10
SLACK = 32 << 20
MiB = 1 << 20


def peer_bound(connected: int, served: int, largest_batch: int) -> int:
    """What ``connected`` replay peers that never read, ``served`` of them with a replay, may
    cost the engine, from the caps."""
    queued = REPLAY_PEER_HWM * (largest_batch + 5 * 64)
    return served * queued + connected * CONNECTION_BYTES + SLACK


def most_served(elapsed_s: float) -> int:
    """Replays that can have begun within ``elapsed_s``: the running and queued ones, and
    those started as stalled ones were abandoned."""
    turns = math.ceil(elapsed_s / REPLAY_STALL_S)
    return MAX_REPLAYS + MAX_QUEUED_REPLAYS + MAX_REPLAYS * turns


# -- unit level: one publisher in this process ----------------------------------------------


def test_the_publishers_caps_are_within_the_stated_ones() -> None:
    assert ep.LIVE_HWM <= LIVE_HWM and ep.REPLAY_PEER_HWM <= REPLAY_PEER_HWM
    assert ep.MAX_REPLAYS <= MAX_REPLAYS and ep.MAX_QUEUED_REPLAYS <= MAX_QUEUED_REPLAYS
    assert ep.REPLAY_STALL_S <= REPLAY_STALL_S and ep.SOCKET_SNDBUF <= SOCKET_SNDBUF
    assert ep.BUFFER_BYTES <= 64 << 20 and ep.MAX_INBOUND_BYTES <= 1024


def test_the_replay_buffer_is_bounded_in_bytes() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = EventPublisher(
        ctx, "inproc://pub", "inproc://replay", buffer_batches=1000, buffer_bytes=64 << 10
    )
    dealer = ctx.socket(zmq.DEALER)
    try:
        big = [BlockRemoved(block_hashes=[bytes(32)] * 30, medium="GPU")]  # ~1 KiB a batch
        seqs = [pub.publish(big) for _ in range(500)]
        batches, held = pub.buffered
        assert held <= 64 << 10 and 50 <= batches < 70  # by bytes, not by the 1,000 batches
        dealer.connect("inproc://replay")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            replayed.append(int.from_bytes(frames[2], "big"))
        assert replayed == seqs[-batches:]  # the newest ones, in order
        huge = [BlockRemoved(block_hashes=[bytes(32)] * 3000, medium="GPU")]  # ~100 KiB
        pub.publish(huge)
        assert pub.buffered[0] == 1  # larger than the cap alone: kept until the next one
        pub.publish(big)
        assert pub.buffered[0] == 1 and pub.buffered[1] < 2 << 10
    finally:
        dealer.close(linger=0)
        pub.close()
        ctx.term()


def test_stalled_replays_are_capped_and_do_not_stop_a_reader() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = EventPublisher(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", token=TOKEN)
    assert pub.replay_endpoint is not None
    hostile: list[zmq.Socket[bytes]] = []
    try:
        batch = [BlockRemoved(block_hashes=[bytes(32)] * 100, medium="GPU")]  # ~3.4 KiB
        for _ in range(2000):  # ~7 MB: more than the kernel takes for a peer
            pub.publish(batch)
        for _ in range(40):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            secure_client(sock, TOKEN)
            sock.connect(pub.replay_endpoint)
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
            hostile.append(sock)
        deadline = time.monotonic() + 10
        while pub.replays_refused < 40 - MAX_REPLAYS - MAX_QUEUED_REPLAYS:
            assert time.monotonic() < deadline, "the queue took more than its bound"
            time.sleep(0.05)
        # four replays stall; after REPLAY_STALL_S they are abandoned and the queue moves
        # (a bounded poll: the same bound as the fixed sleep of REPLAY_STALL_S + 1.5 it replaced)
        deadline = time.monotonic() + REPLAY_STALL_S + 1.5
        while pub.replays_abandoned < MAX_REPLAYS:
            assert time.monotonic() < deadline, f"{pub.replays_abandoned} replays abandoned"
            time.sleep(0.05)
        # a reader gets its whole replay once its turn comes (the picker retries meanwhile)
        reader = ctx.socket(zmq.DEALER)
        secure_client(reader, TOKEN)
        reader.connect(pub.replay_endpoint)
        got: list[int] = []
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                reader.send_multipart((b"", (0).to_bytes(8, "big")))
                got = []
                while reader.poll(1000):
                    frames = reader.recv_multipart()
                    if frames[2] == END_SEQ:
                        break
                    got.append(int.from_bytes(frames[2], "big"))
                else:
                    continue  # not answered in time: ask again, as the picker does
                break
        finally:
            reader.close(linger=0)
        assert got == list(range(2000))
    finally:
        for sock in hostile:
            sock.close(linger=0)
        pub.close()
        ctx.term()


def test_a_live_subscriber_that_does_not_read_holds_at_most_the_hwm() -> None:
    """The live PUB drops a silent subscriber's batches beyond ``LIVE_HWM`` (before the fix:
    100,000) and what the kernel holds (``SOCKET_SNDBUF``): when it reads again it gets the
    oldest ones and then a gap. Publishing never blocks."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = EventPublisher(ctx, "tcp://127.0.0.1:*", token=TOKEN)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
        secure_client(sub, TOKEN)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        for _ in range(200):  # until the subscription is in: then it never reads again
            pub.publish([])
            if sub.poll(50):
                break
        assert sub.poll(0)
        while sub.poll(100):
            sub.recv_multipart()
        batch = [BlockRemoved(block_hashes=[bytes(32)] * 100, medium="GPU")]  # ~3.4 KiB
        started = time.monotonic()
        seqs = [pub.publish(batch) for _ in range(3000)]
        assert time.monotonic() - started < 10  # never blocked
        time.sleep(0.5)
        received = []  # now it reads: what the engine had kept for it, and nothing more
        while sub.poll(500):
            received.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        in_kernel = 4 * SOCKET_SNDBUF // 3400  # the doubled send buffer, and the peer's
        assert 0 < len(received) <= LIVE_HWM + in_kernel + 2
        assert received == seqs[: len(received)]  # the oldest ones; the rest was dropped
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()


# -- a real engine ------------------------------------------------------------------------


class Running:
    def __init__(self, serve: Proc, replay: str) -> None:
        self.serve = serve
        self.replay = replay  # the KV stream's replay endpoint
        engines = [p for p in children(serve.popen.pid) if b"engine" in _cmdline(p)]
        assert len(engines) == 1, engines
        self.engine_pid = engines[0]

    def engine_rss(self) -> int:
        for line in Path(f"/proc/{self.engine_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    replay = f"tcp://127.0.0.1:{free_port()}"
    args = ["serve", "--port", "0", "--model", str(tiny_model_dir())]
    args += ["--served-model-name", "tiny", "--max-num-batched-tokens", "4096"]
    args += ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    args += ["--kv-events-replay-endpoint", replay]
    env = {"MMIS_ENGINE_EVENTS_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    directory = tmp_path_factory.mktemp("event-bounds")
    serve = Proc("event-bounds-serve", args, directory, env, announces=True)
    try:
        serve.wait_http("/ready", 300)
        yield Running(serve, replay)
    finally:
        serve.stop()


def _fill(running: Running) -> None:
    rng = random.Random(41)
    with httpx.Client(base_url=running.serve.root_url, timeout=120) as http:
        for _ in range(REQUESTS):
            prompt = [rng.randrange(5, 448) for _ in range(PROMPT_TOKENS)]  # unique blocks
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text


def _replay(endpoint: str, wait_s: float = 5.0) -> list[bytes] | None:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    secure_client(dealer, TOKEN)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        payloads = []
        while dealer.poll(int(wait_s * 1000)):
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return payloads
            payloads.append(frames[3])
        return None
    finally:
        dealer.close(linger=0)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_400_idle_replay_peers_cost_bounded_memory(running: Running) -> None:
    _fill(running)
    buffered = _replay(running.replay, wait_s=30)
    assert buffered is not None
    stored = [
        p for p in buffered if any(isinstance(e, BlockStored) for e in KV_DECODER.decode(p).events)
    ]
    assert len(stored) >= REQUESTS
    largest = max(len(p) for p in buffered)
    total = sum(len(p) for p in buffered)
    time.sleep(1.0)
    before = running.engine_rss()

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, PEERS + 64)
    peers: list[zmq.Socket[bytes]] = []
    started = time.monotonic()
    try:
        for _ in range(PEERS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)  # never reads: keep as little as possible here
            sock.setsockopt(zmq.RCVBUF, 4096)
            secure_client(sock, TOKEN)
            sock.connect(running.replay)
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
            peers.append(sock)
        peak = before
        while time.monotonic() - started < OBSERVE_S:
            peak = max(peak, running.engine_rss())
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        served = sum(1 for sock in peers if sock.poll(0))
    finally:
        for sock in peers:
            sock.close(linger=0)
        ctx.term()
    growth = peak - before
    bound = peer_bound(PEERS, most_served(elapsed), largest)
    print(
        f"\nreplay buffer {len(buffered)} batches, {total / MiB:.2f} MiB, largest {largest} B; "
        f"engine RSS {before / MiB:.0f} MiB before, peak +{growth / MiB:.1f} MiB with "
        f"{PEERS} peers ({served} served within {elapsed:.0f} s); bound {bound / MiB:.0f} MiB "
        f"({peer_bound(PEERS, PEERS, largest) / MiB:.0f} MiB were all served)"
    )
    assert growth <= bound, f"{PEERS} idle replay peers took the engine up {growth / MiB:.0f} MiB"
    assert served <= most_served(elapsed), f"{served} peers got a replay at once"

    # after they left: a reading replay gets the whole buffer, and the server still serves.
    # Asked again until answered, as the picker does (a bounded poll, not a sleep of
    # REPLAY_STALL_S + 1): a replay whose peer left is abandoned at its next send
    # (EHOSTUNREACH), so the places free at once, and a request made while none was free
    # is dropped unanswered
    deadline = time.monotonic() + REPLAY_STALL_S + 10
    after = None
    while after is None and time.monotonic() < deadline:
        after = _replay(running.replay, wait_s=2)
    assert after is not None and after[: len(buffered)] == buffered
    print(f"engine RSS after the peers left: +{(running.engine_rss() - before) / MiB:.1f} MiB")
    answer = httpx.post(
        running.serve.root_url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
