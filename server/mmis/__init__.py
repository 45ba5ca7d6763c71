"""mmis: Kubernetes-native serving of multimodal (image + text) models.

P0 (``mmis.frontend``) and P1 (``mmis.engine``) are independent packages that meet only through
``mmis.protocol`` (the wire format, a leaf) and the shared ``multimodal``, ``shm`` and
``telemetry`` packages. docs/ARCHITECTURE.md walks one request through the code.
"""

__version__ = "0.1.0"
