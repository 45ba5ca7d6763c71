"""A real P1-side reader process for the cross-process tests (run as a script, not a test).

Usage: ``python reader_child.py DIRECTORY SEGMENT``. Reads length-prefixed msgpack commands
on stdin, answers each on stdout:

- ``["read_ack", [ShmAddress...]]`` -> for each: ``{name: "dtype shape sha256"}`` after
  copying the payload out and acknowledging it, or the error class name;
- ``["ack", [ShmAddress...]]`` -> for each: the ack result (true/false) or the error name;
- ``["exit", []]`` -> ``"bye"`` and exit 0.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import Any

import msgspec

from mmis.protocol.messages import ShmAddress
from mmis.shm import ShmError, ShmReader

Command = tuple[str, list[ShmAddress]]
_LEN = struct.Struct("<I")


def describe(arrays: dict[str, Any]) -> dict[str, str]:
    return {
        name: f"{a.dtype.str} {list(a.shape)} {hashlib.sha256(a.tobytes()).hexdigest()}"
        for name, a in arrays.items()
    }


def handle(reader: ShmReader, op: str, address: ShmAddress) -> Any:
    try:
        if op == "read_ack":
            described = describe(reader.read(address, copy=True))
            reader.ack(address)
            return described
        return reader.ack(address)
    except ShmError as exc:
        return type(exc).__name__


def main() -> int:
    directory, segment = sys.argv[1], sys.argv[2]
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    decoder = msgspec.msgpack.Decoder(Command)
    with ShmReader(segment, directory=directory) as reader:
        while header := stdin.read(_LEN.size):
            (size,) = _LEN.unpack(header)
            op, addresses = decoder.decode(stdin.read(size))
            reply: Any = "bye" if op == "exit" else [handle(reader, op, a) for a in addresses]
            body = msgspec.msgpack.encode(reply)
            stdout.write(_LEN.pack(len(body)) + body)
            stdout.flush()
            if op == "exit":
                return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
