"""``kubectl wait`` past its one known false start, and CRDs applied until they are usable.

Invariants:
  * ``kubectl wait --for=condition=...`` (or ``jsonpath``) exits at once, without waiting,
    with an "accessor error" while the object's ``.status`` (or its ``conditions``) is still
    null, and ``kubectl wait -l SELECTOR`` with "no matching resources found" while no object
    matches yet (a Deployment's pods are created asynchronously); :func:`kubectl_wait` runs
    it again in exactly those cases (at most ``attempts`` times, half a second apart for the
    second) and returns the last result, success or not, for the caller to judge;
  * :func:`apply_crds` returns only when every named CRD is ``Established`` (so resources of
    its kind can be created right away); otherwise it raises :class:`KubectlError` carrying
    kubectl's stderr. Applying is server-side, so running it again is harmless.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .cluster import Cluster, KubectlError

ACCESSOR_ERROR = "accessor error"  # kubectl's words for "that status field is still null"
NO_MATCH = "no matching resources found"  # a label selector that matches nothing (yet)


def kubectl_wait(
    cluster: Cluster, *args: str, timeout_s: float = 60.0, attempts: int = 30
) -> subprocess.CompletedProcess[str]:
    """``kubectl wait *args --timeout=<timeout_s>s``; ``args`` name the object, ``--for``
    and the namespace. Never raises for a failed wait: check ``returncode``."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    while True:
        proc = cluster.kubectl(
            "wait", *args, f"--timeout={timeout_s:g}s", check=False, timeout=timeout_s + 20
        )
        attempts -= 1
        early = ACCESSOR_ERROR in proc.stderr or NO_MATCH in proc.stderr
        if proc.returncode == 0 or not early or attempts == 0:
            return proc
        if NO_MATCH in proc.stderr:
            time.sleep(0.5)  # kubectl returned at once; the objects are still being created


def apply_crds(cluster: Cluster, path: Path, *names: str) -> None:
    """Apply the CRD file or folder ``path`` and wait until each of ``names`` is Established."""
    cluster.kubectl("apply", "--server-side", "-f", str(path))
    for name in names:
        proc = kubectl_wait(cluster, "--for=condition=Established", f"crd/{name}")
        if proc.returncode != 0:
            raise KubectlError(proc.returncode, proc.args, proc.stdout, proc.stderr)
