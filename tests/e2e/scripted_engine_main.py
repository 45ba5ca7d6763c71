"""Run the scripted P1 of ``tests/frontend/fake_engine.py`` as its own process.

Usage: ``python scripted_engine_main.py DIR [--epoch E] [--force-misses N]``. The engine
binds ``ipc://DIR/p1-in`` and ``ipc://DIR/p1-out`` (the addresses :class:`procs.Engine`
uses), prints ``ready`` on stdout once both sockets are bound, then obeys one command per
stdin line and acknowledges each with one stdout line, so a test changes the knobs at a
point it controls (no timing involved):

- ``force N``: the next ``N`` requests fail with ``multimodal_cache_miss`` even with data;
- ``pause-after-first-token``: generation stops after the next token went out;
- ``release``: generation resumes.

``--force-misses`` sets the budget at start; note that P0's readiness probe sends a
synthetic request which would consume it, so tests normally use ``force`` after ready.
The process exits on SIGTERM or when stdin closes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "frontend"))
from fake_engine import FakeEngine


def _commands(engine: FakeEngine, stop: threading.Event) -> None:
    for raw in sys.stdin:
        words = raw.split()
        if not words:
            continue
        if words[0] == "force" and len(words) == 2:
            engine.force_misses(int(words[1]))
        elif words[0] == "pause-after-first-token":
            engine.core.pause_after_first_token = True
        elif words[0] == "release":
            engine.core.pause_after_first_token = False
            engine.core.gate.set()
        else:
            print(f"error unknown command {raw.strip()!r}", flush=True)
            continue
        print("ok", flush=True)
    stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--epoch", default="epoch-1")
    parser.add_argument("--force-misses", type=int, default=0)
    args = parser.parse_args(argv)
    engine = FakeEngine(args.directory, epoch=args.epoch).start()
    engine.force_misses(args.force_misses)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=_commands, args=(engine, stop), daemon=True).start()
    print("ready", flush=True)
    try:
        stop.wait()
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
