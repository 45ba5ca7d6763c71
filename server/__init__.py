"""mmis.server: the serving side of mmis.

P0 (``frontend``) and P1 (``engine``) are independent packages that meet only through
``protocol`` (the wire format, a leaf) and the shared helpers in ``multimodal`` and ``shm``.
"""
