"""``tests/tools.Daemon``, the process wrapper every e2e test and serve benchmark uses.

The children are tiny Python scripts, so each behaviour is checked on a real process: the
address line is read, stdout keeps being drained after it (a child writing far more than a
pipe holds still finishes), a child that does not announce is stopped with its log in the
error, and a child that ignores SIGTERM is SIGKILLed after the bound.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import Daemon

PIPE_FLOOD = 1 << 20  # bytes written after the address line: 16x a Linux pipe's buffer


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stdout_is_drained_after_the_address_line(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "print('listening on http://127.0.0.1:1234', flush=True)\n"
        f"for i in range({PIPE_FLOOD // 64}): sys.stdout.write(f'{{i:063d}}\\n')\n"
        "print('last line', flush=True)\n"
    )
    daemon = Daemon("flood", _python(code), tmp_path, announces=True)
    try:
        assert daemon.root_url == "http://127.0.0.1:1234"
        try:
            assert daemon.popen.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:
            pytest.fail("the child blocked on a full stdout pipe: nobody drains it")
    finally:
        daemon.stop()
    log = daemon.log_path.read_text()
    assert log.startswith("listening on http://127.0.0.1:1234\n")
    assert log.endswith("last line\n")  # the drain copies stdout into the log, to EOF


def test_a_child_that_does_not_announce_fails_with_its_log(tmp_path: Path) -> None:
    code = "import sys\nprint('model not found', file=sys.stderr)\nprint('oops')\nsys.exit(3)"
    with pytest.raises(RuntimeError, match="did not start") as failed:
        Daemon("mute", _python(code), tmp_path, announces=True)
    assert "b'oops\\n'" in str(failed.value)
    assert "model not found" in str(failed.value)


def test_sigterm_is_escalated_to_sigkill_after_the_bound(tmp_path: Path) -> None:
    code = (
        "import signal, sys, threading\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('listening on http://127.0.0.1:1', flush=True)\n"  # only once SIGTERM is ignored
        "threading.Event().wait()\n"
    )
    daemon = Daemon("stubborn", _python(code), tmp_path, announces=True)
    assert daemon.stop(timeout=0.5) == -signal.SIGKILL
