"""Who owns a segment file, and reclaiming the files of writers that died.

A front end killed uncleanly (SIGKILL, OOM kill) leaves its segment and key file in the shm
directory, a memory ``emptyDir`` sized for one store: the restarted front end could not
reserve its own store. So every writer, before creating its segment, reclaims the segments
whose owner is gone (:func:`reclaim_stale`).

Invariants:
- A writer holds an exclusive ``flock`` on its segment file for its whole life. The lock
  lives in the kernel on the open file, so it goes away with the process however it dies,
  and it is seen across PID namespaces (the containers of one pod share the directory, not
  their process ids).
- :func:`reclaim_stale` removes a segment (and its key file) only while holding that lock
  itself, so a live writer's segment is never removed. A new writer takes its lock right
  after creating its file and then checks the file is still linked (:func:`lock_new`), so a
  scan racing a creation can never leave a writer with an unlinked file.
- Removing the file frees its memory once the last mapping is gone: P1 drops the mappings of
  removed segments on its own (:meth:`mmis.shm.reader_set.ShmReaderSet.prune`), and
  :class:`mmis.shm.writer.ShmWriter` retries reserving its store for a bounded time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from mmis.shm import signing
from mmis.shm.errors import ShmSegmentError

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "mmis-"


class LostRaceError(ShmSegmentError):
    """A scan removed a segment file between its creation and its lock: pick a new name."""


def lock_new(fd: int, path: Path) -> None:
    """Take the owner's lock on a just-created segment file (or :class:`LostRaceError`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LostRaceError(f"{path} was locked by a scan right after its creation") from None
    if os.fstat(fd).st_nlink == 0:
        raise LostRaceError(f"{path} was reclaimed right after its creation")


def _is_segment(path: Path) -> bool:
    name = path.name
    return (
        name.startswith(SEGMENT_PREFIX)
        and not name.endswith(signing.KEY_SUFFIX)
        and path.is_file()
        and not path.is_symlink()
    )


def _is_orphan_key(path: Path) -> bool:
    name = path.name
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(signing.KEY_SUFFIX)):
        return False
    return not (path.parent / name.removesuffix(signing.KEY_SUFFIX)).exists()


def reclaim_stale(directory: Path) -> list[str]:
    """Remove every segment in ``directory`` whose writer is gone; the names removed."""
    removed: list[str] = []
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return removed
    for path in entries:
        if _is_orphan_key(path):
            path.unlink(missing_ok=True)  # its writer died between its two files
            continue
        if not _is_segment(path):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer holds it
            if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                continue  # replaced since we opened it
            path.unlink(missing_ok=True)
            signing.key_path(directory, path.name).unlink(missing_ok=True)
            removed.append(path.name)
        except OSError:
            continue
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    if removed:
        log.warning(
            "reclaimed %d stale shared-memory segment(s) in %s (their writer died): %s",
            len(removed),
            directory,
            ", ".join(removed),
        )
    return removed
