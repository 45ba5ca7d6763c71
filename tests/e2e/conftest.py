"""Fixtures shared by the end-to-end modules (real ``mmis`` processes of ``procs.py``).

- :func:`start_serve` (session): a factory. ``with start_serve(name, *flags) as proc`` runs
  ``mmis serve --port 0 *flags`` offline (``env`` on top of the environment), waits for
  ``/ready`` (``ready_s``) and stops the server when the block ends; each module states its
  model, served name and flags at the use site and scopes its server as its tests need.
- :func:`tiny_serve` and :func:`tiny_serve_evicting` (session): ONE ``mmis serve`` on the
  tiny LLaVA each (served as ``tiny`` and ``mmis-tiny``, one OpenMP thread), the second with
  the operator-only fault knob (``--fault-evict-rate 1``: P1 drops every cached item, so
  each repeat of an image is a drift miss that the recovery chain heals). Shared by modules
  whose tests neither stop, fault nor reconfigure the server and read its counters only as
  differences within one test (a session runs its tests one at a time):
  ``test_logprobs``, ``test_sampling_params`` and ``test_quiet_logs`` (which reads its log)
  use the first, ``test_responses_api`` and
  ``test_structured_outputs`` the second. A module that reads state of a fresh server keeps
  its own, module-scoped, through :func:`start_serve`.
- :func:`family_serve` (session): a factory, ``family_serve(family)`` is ONE ``mmis serve`` per
  model family on the tiny model of ``tiny_model_dir(family)`` (served as ``m``, one OpenMP
  and engine thread, ``procs.family_flags``), started at its first use and kept to the
  session's end, on the same terms as :func:`tiny_serve`: ``test_families_serve`` and
  ``test_video`` ask it as transformers' reference, ``test_epd_e2e`` as the aggregated
  reference of ``mmis serve --encoders 1`` (launched with the same flags).
- :func:`launch` (function): a :class:`procs.Launcher`; what it started stops after the test.
- :func:`procs` (function): the processes a test started and appended; after the test each
  is resumed (SIGCONT, in case the test stopped it) and SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import ONE_ENGINE_THREAD, Launcher, Proc, ServeFactory, family_flags

from mmis.tiny_models.tiny_model import tiny_model_dir

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def start_serve(tmp_path_factory: pytest.TempPathFactory) -> ServeFactory:
    @contextmanager
    def start(
        name: str, *flags: str, env: dict[str, str] | None = None, ready_s: float = 300.0
    ) -> Iterator[Proc]:
        args = ["serve", "--port", "0", *flags]
        proc = Proc(name, args, tmp_path_factory.mktemp(name), env, announces=True)
        try:
            proc.wait_http("/ready", ready_s)
            yield proc
        finally:
            proc.stop()

    return start


def _tiny_llava(*flags: str) -> tuple[str, ...]:
    return ("--model", str(tiny_model_dir()), "--served-model-name", "tiny,mmis-tiny", *flags)


@pytest.fixture(scope="session")
def tiny_serve(start_serve: ServeFactory) -> Iterator[Proc]:
    with start_serve("serve-tiny", *_tiny_llava(), env=ONE_THREAD) as proc:
        yield proc


@pytest.fixture(scope="session")
def tiny_serve_evicting(start_serve: ServeFactory) -> Iterator[Proc]:
    flags = _tiny_llava("--fault-evict-rate", "1")
    with start_serve("serve-tiny-evicting", *flags, env=ONE_THREAD) as proc:
        yield proc


@pytest.fixture(scope="session")
def family_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Proc]]:
    servers: dict[str, Proc] = {}

    def get(family: str) -> Proc:
        """The family's server, launched and waited for at its first use (threads may ask
        for different families at once: their servers load side by side)."""
        if family not in servers:
            args, name = ["serve", "--port", "0", *family_flags(family)], f"serve-{family}"
            tmp = tmp_path_factory.mktemp(name)
            proc = Proc(name, args, tmp, ONE_ENGINE_THREAD, announces=True)
            try:
                proc.wait_http("/ready", 300)
            except BaseException:
                proc.stop()
                raise
            servers[family] = proc
        return servers[family]

    try:
        yield get
    finally:  # side by side: the session's end waits for the slowest stop, not the sum
        with ThreadPoolExecutor(max(len(servers), 1)) as pool:
            list(pool.map(Proc.stop, servers.values()))


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        if proc.popen.poll() is None:
            os.kill(proc.popen.pid, signal.SIGCONT)
        proc.stop(signal.SIGKILL)
