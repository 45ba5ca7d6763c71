"""The shared-memory object store: one writer (P0), readers that acknowledge (P1).

See :mod:`mmis.server.shm.writer` for the protocol and :mod:`mmis.server.shm.layout` for the
segment format. Public names are re-exported here.
"""

from mmis.server.shm.errors import (
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
from mmis.server.shm.reader import ShmReader
from mmis.server.shm.reader_set import ShmReaderSet
from mmis.server.shm.receive import receive_features
from mmis.server.shm.ring import ShmStats
from mmis.server.shm.writer import ShmWriter

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
    "receive_features",
]
