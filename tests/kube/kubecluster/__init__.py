"""A real Kubernetes control plane for tests, without Docker (see ``cluster.Cluster``).

Stdlib-only apart from ``Cluster.api_client`` (needs the ``kubernetes`` package); it does
not import mmis, so ``scripts/controlplane`` can run it with any Python >= 3.11.
"""

from .cluster import GPUS_PER_NODE, Cluster, KubectlError
from .gomod import go_mod_cache, inference_pool_crd, module_file
from .process import ComponentError
from .tools import Tools, ToolsMissing, find_tools
from .waits import apply_crds, kubectl_wait

__all__ = [
    "GPUS_PER_NODE",
    "Cluster",
    "ComponentError",
    "KubectlError",
    "Tools",
    "ToolsMissing",
    "apply_crds",
    "find_tools",
    "go_mod_cache",
    "inference_pool_crd",
    "kubectl_wait",
    "module_file",
]
