"""Names shared by the CRD, the builders and the handlers: one place, so they never disagree.

Invariants:
- The API group, version, plural and kind match ``crds/mminferenceservice.yaml`` exactly.
- Everything the operator stores on objects (finalizer, kopf progress annotations, labels)
  lives under the ``mmis.dev`` prefix.
- The engine <-> front end ZMQ addresses are defined here once and passed to both containers.
"""

from __future__ import annotations

GROUP = "mmis.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MMInferenceService"
PLURAL = "mminferenceservices"
SHORT_NAME = "mmis"

FINALIZER = f"{GROUP}/finalizer"
ANNOTATION_PREFIX = GROUP
FIELD_MANAGER = "mmis-operator"
REPORTING_COMPONENT = "mmis-operator"

# labels on every child and on the pods
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = f"{GROUP}/service"  # the owning MMInferenceService's name
APP_NAME = "mmis"
COMPONENT = "inference"
MANAGED_BY = "mmis-operator"

# containers and ports of an inference pod
FRONTEND = "frontend"
ENGINE = "engine"
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
# /metrics and /stats/cache (front end's --ops-port): pod to pod only, never on the Service
OPS_PORT = 8001
OPS_PORT_NAME = "ops"
# the engine's own probe endpoint (mmis engine --health-port): kubelet only
ENGINE_HEALTH_PORT = 8002
ENGINE_HEALTH_PORT_NAME = "engine-health"
ENGINE_INPUT_ADDRESS = "tcp://127.0.0.1:5570"
ENGINE_OUTPUT_ADDRESS = "tcp://127.0.0.1:5571"
SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"
GPU_RESOURCE = "nvidia.com/gpu"
RUN_AS_USER = 1000

# condition types the operator owns (CacheCoherent: the coherence probe, the others: reconciler;
# Routing only while spec.routing is set)
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CACHE_COHERENT = "CacheCoherent"
ROUTING = "Routing"


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select one service's pods (stable for the Deployment's lifetime)."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: name, LABEL_SERVICE: name}


def selector_string(name: str) -> str:
    """``selector_labels`` as a label-selector string (``status.selector``, scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def child_labels(name: str) -> dict[str, str]:
    """Labels on every child object and pod: the selector plus component and manager."""
    return {**selector_labels(name), LABEL_COMPONENT: COMPONENT, LABEL_MANAGED_BY: MANAGED_BY}
