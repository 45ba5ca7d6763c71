"""``mmis wait-frontend --lock FILE --timeout-s N``: wait until no front end of the pod lives.

The engine container's preStop hook (docs/SECURITY.md, "Termination in order"). On pod
deletion kubelet runs every container's preStop at once and sends a container SIGTERM only
after its own preStop returned; every ``mmis frontend --drain-lock FILE`` holds a shared
``flock`` on FILE for as long as it lives (the kernel drops it however the process exits).
This command returns as soon as it can take the lock exclusively, i.e. when no front-end
process holds it any more, so the engine is stopped only after P0 has drained.

Invariants:
- Exit status 0 whether every front end exited, FILE does not exist (no front end ever took
  it: at once), or N seconds passed (a preStop that fails only delays the stop, and the pod's
  grace period bounds it anyway); the one stdout line says which. Exit 1 only when FILE
  exists but cannot be opened (the line says why), 2 for bad arguments.
- It never creates FILE and holds the exclusive lock only for the instant between taking and
  exiting, so a front end starting meanwhile waits at most that long for its shared one.
- Standard library only, no ``mmis`` package beyond the CLI: it starts in tens of
  milliseconds (``python -X importtime``), whatever the engine's image imports elsewhere.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import threading
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock",
        required=True,
        metavar="FILE",
        help="the front end's --drain-lock file (e.g. /dev/shm/frontend-drain.lock)",
    )
    parser.add_argument(
        "--timeout-s",
        required=True,
        type=float,
        metavar="N",
        help="give up (still exit 0) after N seconds: the front end's preStop pause plus its "
        "--graceful-shutdown-s plus its shutdown, within the pod's grace period",
    )


def wait_unlocked(path: str, timeout_s: float) -> str:
    """Block until ``path`` can be locked exclusively or ``timeout_s`` passed; what happened,
    in one line (``OSError`` when ``path`` exists but cannot be opened)."""
    started = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"no front end: {path} does not exist"
    try:
        free = threading.Event()

        def take() -> None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while any front end holds its shared lock
            free.set()

        threading.Thread(target=take, name="flock", daemon=True).start()
        if free.wait(max(0.0, timeout_s)):
            waited = time.monotonic() - started
            return f"every front end has exited ({path} free after {waited:.1f}s)"
        return f"gave up after {timeout_s:g}s: a front end still holds {path}"
    finally:
        os.close(fd)  # drops the lock if it was taken; a blocked flock dies with the process


def run(args: argparse.Namespace) -> int:
    try:
        line = wait_unlocked(args.lock, args.timeout_s)
    except OSError as exc:
        print(f"mmis wait-frontend: cannot open {args.lock}: {exc}", flush=True)
        return 1
    print(f"mmis wait-frontend: {line}", flush=True)
    return 0
