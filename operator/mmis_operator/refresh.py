"""Status refreshes coalesced per resource: the newest Deployment and pod events win.

The operator's watch handlers (``handlers.deployment_event`` / ``pod_event``) run on kopf's
event loop and only submit here; the refresh itself (API calls: a LIST of pods, a GET and a
PUT of the status) runs in one of the refresher's own threads, never queued behind the
reconciles of 100 resources created at once (they use the loop's default executor).
A Deployment rolling out emits several status updates within a second and each of its pods
several more: one refresh per burst instead of one per event (benchmarks/bench_operator.py,
benchmarks/README.md).

Invariants:
- At most one refresh per resource runs at a time, and it uses the newest Deployment event
  seen for it (``latest wins``): a stale event is never written after a newer one.
- Nothing submitted is lost: an event arriving while that resource's refresh runs is taken
  by the next round of the same drain task, which starts ``delay`` seconds later.
- A round runs the newest Deployment event first (it reads the pods itself while they are not all
  ready), then each pod's newest event (``Reconciler.pod_changed``: cheap unless a pod shows a
  problem or the resource's last status had one), so a pod problem surfaces in that round.
- A reconcile's own status write uses the Deployment as it applied it, which the Deployment's
  events may have overtaken meanwhile (under load, a resource was left "ReplicasNotReady" with
  its pod ready): after each successful reconcile a ``fresh`` job (GET the Deployment, write)
  runs last in the next round, so the last write of a burst always reads the current state.
- A refresh that fails is logged and dropped: the next event or the resync timer repairs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mmis_operator.kube import KubeError

logger = logging.getLogger(__name__)

THREADS = 4  # own threads: refreshes never queue behind a burst of reconciles
Key = tuple[str, str]  # (namespace, resource name)
Job = Callable[[], None]


@dataclasses.dataclass
class _Pending:
    deployment: Job | None = None
    pods: dict[str, Job] = dataclasses.field(default_factory=dict)  # pod name -> newest
    fresh: Job | None = None  # after a reconcile: status from the Deployment as it is now


class Refresher:
    """Per-resource latest-wins refreshes; ``submit_*`` must be called on the event loop."""

    def __init__(self, delay: float = 0.2, threads: int = THREADS) -> None:
        if delay < 0:
            raise ValueError(f"refresh delay must not be negative, got {delay}")
        self.delay = delay
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None  # made on first use
        self._pending: dict[Key, _Pending] = {}
        self._drains: dict[Key, asyncio.Task[None]] = {}

    def submit_deployment(self, key: Key, job: Job) -> None:
        self._slot(key).deployment = job

    def submit_pod(self, key: Key, pod: str, job: Job) -> None:
        self._slot(key).pods[pod] = job

    def submit_fresh(self, key: Key, job: Job) -> None:
        self._slot(key).fresh = job

    def _slot(self, key: Key) -> _Pending:
        slot = self._pending.setdefault(key, _Pending())
        if key not in self._drains:
            self._drains[key] = asyncio.get_running_loop().create_task(self._drain(key))
        return slot

    async def _drain(self, key: Key) -> None:
        try:
            while True:
                await asyncio.sleep(self.delay)  # let the rest of the burst arrive
                slot = self._pending.pop(key, None)
                if slot is None:
                    return  # no await between this check and the finally: nothing is missed
                jobs = [slot.deployment, *slot.pods.values(), slot.fresh]
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.threads, "mmis-refresh")
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._executor, _run_all, key, jobs)
        finally:
            self._drains.pop(key, None)

    async def idle(self) -> None:
        """Wait until every submitted refresh has run (tests)."""
        while self._drains:
            await asyncio.gather(*list(self._drains.values()), return_exceptions=True)


def _run_all(key: Key, jobs: list[Job | None]) -> None:
    for job in filter(None, jobs):
        try:
            job()
        except KubeError as exc:  # the next event or the resync timer will catch up
            logger.warning("status refresh of %s/%s failed: %s", *key, exc)
        except Exception:  # a bug: say so loudly, but keep refreshing the other resources
            logger.exception("status refresh of %s/%s failed", *key)
