"""``python -m kubecluster serve --state-dir DIR``: run one cluster until SIGTERM/SIGINT.

This is the foreground half of ``scripts/controlplane up``; the script detaches it.

Invariants:
  * ``DIR/ready`` appears (holding the kubeconfig path) only once the cluster is usable;
    on a failed start ``DIR/failed`` holds the reason and the exit status is 1;
  * on SIGTERM, SIGINT or SIGHUP every component is stopped and ``DIR/cluster`` removed
    before exit; ``DIR`` itself (with ``serve.log``) stays for the script to clean up.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from .cluster import Cluster
from .tools import ToolsMissing, find_tools


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def serve(state_dir: Path, nodes: int) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "ready").unlink(missing_ok=True)
    (state_dir / "failed").unlink(missing_ok=True)
    workdir = state_dir / "cluster"
    shutil.rmtree(workdir, ignore_errors=True)
    try:
        tools = find_tools(build=False)
    except ToolsMissing as exc:
        (state_dir / "failed").write_text(f"{exc}\n")
        return 1
    cluster = Cluster(tools, workdir=workdir, nodes=nodes)
    try:
        try:
            cluster.start()
        except Exception as exc:
            (state_dir / "failed").write_text(f"{type(exc).__name__}: {exc}\n")
            return 1
        (state_dir / "ready").write_text(f"{cluster.kubeconfig}\n")
        print(f"control plane ready: {cluster.server} pids {cluster.pids()}", flush=True)
        idle = threading.Event()  # never set: we wait for a signal, checking liveness
        while not idle.wait(2.0):
            dead = [name for name, alive in cluster.alive().items() if not alive]
            if dead:
                print(f"components exited: {', '.join(dead)}; see {workdir}/logs", flush=True)
                return 1
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        (state_dir / "ready").unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubecluster")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run a control plane until signalled")
    p_serve.add_argument("--state-dir", type=Path, required=True)
    p_serve.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args(argv)
    return serve(args.state_dir, args.nodes)


if __name__ == "__main__":
    sys.exit(main())
