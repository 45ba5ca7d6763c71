"""A libzmq event publisher with PLAIN + ZAP, for router/pkg/events/plain_test.go: the picker's
go-zeromq PLAIN client must get through libzmq's PLAIN server and its ZAP handler with the
right token, and nowhere without it (docs/SECURITY.md, "The internal token").

usage: plain_engine.py TOKEN. Prints "ports PUB ROUTER", then one line per ZAP decision
("zap 200 mmis" / "zap 400 <user>"). Serves replays of its buffer and publishes a new batch
every 100 ms, until stdin closes.
"""

from __future__ import annotations

import struct
import sys
import threading
import time

import msgspec
import zmq

END = b"\xff" * 8


def batch(*events: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events)])


def main() -> None:
    token = sys.argv[1].encode()
    ctx = zmq.Context()
    zap = ctx.socket(zmq.REP)
    zap.bind("inproc://zeromq.zap.01")
    lock = threading.Lock()
    buffer = [
        batch({"type": "AllBlocksCleared"}),
        batch({"type": "BlockStored", "block_hashes": [b"plain-block"]}),
    ]

    def say(line: str) -> None:
        with lock:
            print(line, flush=True)

    def authenticate() -> None:
        while True:
            frames = zap.recv_multipart()
            version, request_id, _domain, _address, _identity, mechanism = frames[:6]
            creds = frames[6:]
            ok = mechanism == b"PLAIN" and creds == [b"mmis", token]
            user = creds[0].decode(errors="replace") if creds else "-"
            code = b"200" if ok else b"400"
            zap.send_multipart([version, request_id, code, b"", user.encode() if ok else b"", b""])
            say(f"zap {code.decode()} {user}")

    threading.Thread(target=authenticate, daemon=True).start()
    socks = []
    for kind in (zmq.PUB, zmq.ROUTER):
        s = ctx.socket(kind)
        s.plain_server = True
        s.zap_domain = b"mmis-events"
        s.linger = 0
        socks.append(s)
    pub, router = socks
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router_port = router.bind_to_random_port("tcp://127.0.0.1")
    say(f"ports {pub_port} {router_port}")

    stop = threading.Event()

    def wait_for_stdin_to_close() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_stdin_to_close, daemon=True).start()
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    next_live = time.monotonic()
    n = 0
    while not stop.is_set():
        if dict(poller.poll(20)).get(router):
            peer, _empty, start = router.recv_multipart()
            (first,) = struct.unpack(">Q", start)
            for seq in range(first, len(buffer)):
                router.send_multipart([peer, b"", b"", struct.pack(">Q", seq), buffer[seq]])
            router.send_multipart([peer, b"", b"", END, b""])
        if time.monotonic() >= next_live:
            next_live += 0.1
            buffer.append(batch({"type": "BlockStored", "block_hashes": [f"live-{n}".encode()]}))
            n += 1
            pub.send_multipart([b"", struct.pack(">Q", len(buffer) - 1), buffer[-1]])
    for s in socks:
        s.close(linger=0)


if __name__ == "__main__":
    main()
