"""Running the operator: in the foreground (``mmis operator``) or in a thread (tests, benches).

Invariants:
- One function, :func:`serve`, builds the registry, settings and client for both modes, so the
  threaded operator tests exercise exactly what ``mmis operator`` runs.
- :class:`OperatorThread` stops through kopf's stop flag (no signals, no thread killing) and
  ``start`` returns only after kopf reports readiness (or raises if it died first).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kopf

from mmis_operator import settings as operator_settings
from mmis_operator.handlers import build_registry
from mmis_operator.kube import Kube
from mmis_operator.probe import CoherenceProbe


async def serve(
    kube: Kube,
    options: operator_settings.Options,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
) -> None:
    settings = operator_settings.configure(kopf.OperatorSettings(), options)
    if options.workers is not None:  # the reconciles and status refreshes (asyncio.to_thread)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(options.workers, thread_name_prefix="mmis-operator")
        )
    await kopf.operator(
        registry=build_registry(
            kube,
            options.resync_seconds,
            CoherenceProbe(kube, options.probe_timeout, options.allow_stats_endpoint_override),
            options.probe_seconds,
            options.allow_fault_injection,
        ),
        settings=settings,
        clusterwide=not options.namespaces,
        namespaces=list(options.namespaces),
        liveness_endpoint=options.liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


class OperatorThread:
    """The operator in a background thread with its own event loop and credentials."""

    def __init__(self, kubeconfig: Path | str, options: operator_settings.Options) -> None:
        self.kube = Kube.from_kubeconfig(kubeconfig)
        self.options = options
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mmis-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(serve(self.kube, self.options, self.stop_flag, self.ready_flag))
        except BaseException as exc:  # reported by start()/stop()
            self.error = exc
        finally:
            self.ready_flag.set()  # unblock start() if kopf died before becoming ready

    def start(self, timeout: float = 60.0) -> OperatorThread:
        self._thread.start()
        if not self.ready_flag.wait(timeout):
            raise TimeoutError(f"the operator was not ready within {timeout}s")
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the operator stopped during start-up: {self.error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_flag.set()
        self._thread.join(timeout)
        self.kube.close()
        if self._thread.is_alive():
            raise TimeoutError(f"the operator did not stop within {timeout}s")

    def __enter__(self) -> OperatorThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
