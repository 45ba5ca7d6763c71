"""Which HTTP requests P0's access log (uvicorn's ``uvicorn.access`` logger) records.

A pod's kubelet probes ``/health`` and ``/ready`` every few seconds, Prometheus scrapes
``/metrics``, the operator reads ``/stats/cache`` and routers call ``/internal/*``: logged,
those lines are most of a container's log and hide the requests a user sent.

Invariants:
- An access line is kept when its path is under :data:`API_PREFIX` (the OpenAI API), or when
  the answer was not a success (status 400 or above: a failing probe, an unknown path, a
  refused token are news), whatever the path.
- Every other line (a successful probe, scrape, stats read, ``/version`` or internal call) is
  dropped; nothing else in the log changes.
- :func:`quiet_access_log` is idempotent: the filter is installed on the logger once per
  process (uvicorn's ``dictConfig`` keeps a logger's filters).
"""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
API_PREFIX = "/v1/"


class ApiAccessOnly(logging.Filter):
    """Keeps uvicorn access records of API paths and of failed answers (the module's rule)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client, method, path with query, http version, status)
        if not isinstance(args, tuple) or len(args) != 5:
            return True  # not an access line this filter knows: keep it
        path, status = args[2], args[4]
        if isinstance(path, str) and path.split("?", 1)[0].startswith(API_PREFIX):
            return True
        return not isinstance(status, int) or status >= 400


def quiet_access_log() -> None:
    """Install :class:`ApiAccessOnly` on uvicorn's access logger (once)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, ApiAccessOnly) for f in logger.filters):
        logger.addFilter(ApiAccessOnly())
