"""The shared-memory object store: one writer (P0), readers that acknowledge (P1).

See :mod:`mmis.shm.writer` for the protocol and :mod:`mmis.shm.layout` for the
segment format. Public names are re-exported here.
"""

from mmis.shm.errors import (
    ForgedHandleError,
    ShmError,
    ShmHandleError,
    ShmPayloadError,
    ShmPayloadTooLargeError,
    ShmSegmentError,
    ShmStoreFullError,
    StaleHandleError,
    UnknownSegmentError,
)
from mmis.shm.reader import ShmReader
from mmis.shm.reader_set import ShmReaderSet
from mmis.shm.ring import ShmStats
from mmis.shm.writer import ShmWriter

__all__ = [
    "ForgedHandleError",
    "ShmError",
    "ShmHandleError",
    "ShmPayloadError",
    "ShmPayloadTooLargeError",
    "ShmReader",
    "ShmReaderSet",
    "ShmSegmentError",
    "ShmStats",
    "ShmStoreFullError",
    "ShmWriter",
    "StaleHandleError",
    "UnknownSegmentError",
]
