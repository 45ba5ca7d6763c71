"""One P0 among N (``--api-servers N``): its index, its siblings, and the answers for all N.

The supervisor (``mmis.entrypoints.api_servers``) makes a private run directory (mode 0700)
and hands each of its N children an :class:`ApiServerGroup`; everything the processes share
is a file or socket in that directory, named here once:

- ``api-server-<i>.sock``: process ``i``'s private unix socket. It answers only the
  operations routes and the probes, with process ``i``'s own figures (``/metrics`` in
  OpenMetrics, every P0 family labelled ``api_server="<i>"``; ``/stats/cache``: its own
  drift window).
- ``api-server-<i>.status``: ``ready`` once process ``i`` has its engine handshake, or the
  one-line cause of its failed start; the supervisor reads it when the process exits.
- ``restarts.json``: how often the supervisor restarted each index (``{"1": 2}``), rendered
  as ``mmis_frontend_api_server_restarts_total{api_server="i"}``.
- ``engine-failed``: written by ``mmis serve`` when P1 failed to start; every process
  starting up stops waiting for P1's handshake at once (:meth:`ApiServerGroup.engine_failed`).
  ``stopping``, written when the supervisor stops, and the supervisor's death end that wait
  the same way: a process still starting never outlives its supervisor by the engine timeout.

Invariants:
- ``/metrics`` and ``/stats/cache`` on the public ports answer for all N whichever process
  accepted the connection: it reads its siblings' private sockets (concurrently, each within
  :data:`SIBLING_TIMEOUT_S`) and merges (:mod:`mmis.telemetry.aggregate`): P1's figures once,
  from the answering process; the drift window as the sum of the N windows. A sibling that
  does not answer (restarting, hung) is left out of that one answer, never waited for beyond
  the bound. Why not Prometheus' multiprocess mode: it has no place for the scrape-time
  collectors (P1's figures, the drift window, P0's levels), keeps per-process files a dead
  process leaves behind, and could not sum the drift window; one port per process would
  change the PodMonitor and the operator's probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Mapping

import httpx
from prometheus_client.core import CounterMetricFamily
from starlette.types import Scope

from mmis.telemetry.aggregate import OPENMETRICS, merge_expositions, sum_drift_stats
from mmis.telemetry.metrics import MMISMetrics

log = logging.getLogger(__name__)

SIBLING_TIMEOUT_S = 2.0
"""How long the answering process waits for one sibling's figures."""
READY = "ready"
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, one the terminating NUL


@dataclasses.dataclass(frozen=True)
class ApiServerGroup:
    """Process ``index`` of ``count`` P0 processes sharing ``run_dir``."""

    index: int
    count: int
    run_dir: str
    parent_pid: int = 0  # the supervisor (0: not checked)

    @property
    def label(self) -> str:
        """This process's ``api_server`` label value."""
        return str(self.index)

    def socket_path(self, index: int) -> str:
        return os.path.join(self.run_dir, f"api-server-{index}.sock")

    def status_path(self, index: int) -> str:
        return os.path.join(self.run_dir, f"api-server-{index}.status")

    @property
    def restarts_path(self) -> str:
        return os.path.join(self.run_dir, "restarts.json")

    @property
    def engine_failed_path(self) -> str:
        return os.path.join(self.run_dir, "engine-failed")

    @property
    def stopping_path(self) -> str:
        return os.path.join(self.run_dir, "stopping")

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    def is_private(self, scope: Scope) -> bool:
        """Whether the request came in on this process's private socket."""
        return tuple(scope.get("server") or ()) == (self.socket_path(self.index), None)

    def engine_failed(self) -> str | None:
        """Why this process should stop waiting for P1's handshake, else ``None``: P1 failed
        to start (``mmis serve`` wrote why), or the supervisor is stopping or gone."""
        if self.parent_pid and os.getppid() != self.parent_pid:
            return "the api-servers supervisor exited before this process was ready"
        if os.path.exists(self.stopping_path):
            return "the api-servers supervisor stopped before this process was ready"
        return read_text(self.engine_failed_path) or None

    def set_status(self, index: int, status: str) -> None:
        write_text(self.status_path(index), status)

    def status(self, index: int) -> str:
        return read_text(self.status_path(index))

    def restarts(self) -> dict[int, int]:
        text = read_text(self.restarts_path)
        try:
            counts = json.loads(text) if text else {}
        except ValueError:
            return {}
        return {int(k): int(v) for k, v in counts.items()} if isinstance(counts, dict) else {}


def write_text(path: str, text: str) -> None:
    """Replace ``path``'s content atomically (a reader sees the old or the new text)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


async def _fetch(path: str, route: str, accept: str | None) -> httpx.Response | None:
    transport = httpx.AsyncHTTPTransport(uds=path)
    headers = {"accept": accept} if accept else {}
    try:
        async with httpx.AsyncClient(transport=transport, timeout=SIBLING_TIMEOUT_S) as client:
            answer = await client.get(f"http://p0{route}", headers=headers)
            answer.raise_for_status()
            return answer
    except httpx.HTTPError as exc:  # restarting or hung: left out of this answer
        log.info("api server socket %s did not answer %s: %s", path, route, exc)
        return None


async def _siblings(group: ApiServerGroup, route: str, accept: str | None) -> list[httpx.Response]:
    answers = await asyncio.gather(
        *(_fetch(group.socket_path(i), route, accept) for i in group.siblings)
    )
    return [a for a in answers if a is not None]


def _restarts_family(group: ApiServerGroup, model: str) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "mmis_frontend_api_server_restarts",
        "Times the supervisor restarted this P0 process (--api-servers) after it died.",
        labels=["model", "api_server"],
    )
    counts = group.restarts()
    for index in range(group.count):
        family.add_metric([model, str(index)], counts.get(index, 0))
    return family


async def group_metrics(
    group: ApiServerGroup, own: MMISMetrics, accept: str | None
) -> tuple[bytes, str]:
    """``/metrics`` for all N: ``own`` is this process's registry."""
    text, _ = own.exposition(OPENMETRICS, api_server=group.label)
    answers = await _siblings(group, "/metrics", OPENMETRICS)
    return merge_expositions(
        text.decode(), [a.text for a in answers], accept, [_restarts_family(group, own.model)]
    )


async def group_cache_stats(group: ApiServerGroup, own: Mapping[str, float]) -> dict[str, float]:
    """``/stats/cache`` for all N: this process's window (``own``) summed with its siblings'."""
    windows = [own]
    for answer in await _siblings(group, "/stats/cache", None):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            window = answer.json()
            sum_drift_stats([window])  # the shape checked before it counts
            windows.append(window)
    return sum_drift_stats(windows)
