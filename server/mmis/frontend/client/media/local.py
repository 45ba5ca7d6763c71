"""``file://`` URLs, allowed only below one root directory (``--allowed-local-media-path``).

Invariants:
- Disabled unless a root is configured: every ``file://`` URL is then a 403.
- The path is resolved (symlinks and ``..``) *before* the containment check, so neither
  ``../`` nor a symlink inside the root can reach a file outside it (403, naming the root).
- The resolved path is opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file:
  a symlink swapped in after the check, a FIFO or a device are refused, never read or waited on.
- At most ``max_bytes + 1`` bytes are read; a larger file is a 400 naming the limit.

Limitation: a directory *between* the root and the file that is replaced by a symlink after
the check is not detected; the root is operator-controlled, so this is accepted.
"""

from __future__ import annotations

import os
import stat
import urllib.parse
from pathlib import Path

from mmis.frontend.errors import (
    InvalidMediaError,
    MediaForbiddenError,
    MediaTooLargeError,
)


class LocalMediaReader:
    def __init__(self, root: str | None, *, max_bytes: int) -> None:
        self.root = Path(root).resolve(strict=False) if root is not None else None
        self.max_bytes = max_bytes

    def path_of(self, url: str, *, param: str | None = None) -> Path:
        """The resolved path a ``file://`` URL names, checked to lie below the root."""
        if self.root is None:
            raise MediaForbiddenError(
                "file:// image URLs are disabled: the server was started without "
                "--allowed-local-media-path",
                param=param,
            )
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() != "file":
            raise InvalidMediaError(f"not a file:// URL: {url!r}", param=param)
        if parts.netloc not in ("", "localhost"):
            raise InvalidMediaError(
                f"file:// URL names a remote host {parts.netloc!r}; only local paths are allowed",
                param=param,
            )
        raw = urllib.parse.unquote(parts.path)
        if "\x00" in raw or not raw.startswith("/"):
            raise InvalidMediaError(
                "file:// URL must hold an absolute path, e.g. file:///data/cat.png", param=param
            )
        resolved = Path(raw).resolve(strict=False)
        if not resolved.is_relative_to(self.root):
            raise MediaForbiddenError(
                f"file:// path {raw!r} resolves outside the allowed media root {str(self.root)!r}",
                param=param,
            )
        return resolved

    def read(self, url: str, *, param: str | None = None) -> bytes:
        """Read the file (blocking: call it from a worker thread)."""
        path = self.path_of(url, param=param)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError as exc:
            raise InvalidMediaError(f"file:// image not found: {str(path)!r}", param=param) from exc
        except OSError as exc:
            raise InvalidMediaError(
                f"cannot open file:// image {str(path)!r}: {exc.strerror}", param=param
            ) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidMediaError(
                    f"file:// image {str(path)!r} is not a regular file", param=param
                )
            if info.st_size > self.max_bytes:
                raise _too_large(path, self.max_bytes, param)
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = fh.read(self.max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.max_bytes:
            raise _too_large(path, self.max_bytes, param)
        return data


def _too_large(path: Path, max_bytes: int, param: str | None) -> MediaTooLargeError:
    return MediaTooLargeError(
        f"file:// image {str(path)!r} is larger than the limit of {max_bytes} bytes", param=param
    )
