"""The writer lock and the restore marker of a MegaContext tree directory.

Both the tree (opening for writing, creating) and the snapshots (restoring) take the lock and look
for the marker, so they live here, under both.
"""

from __future__ import annotations

import errno
import fcntl
import os

from mcf.errors import MCFIOError, os_error

__all__ = ["LOCK_FILE", "RESTORE_MARKER", "acquire_lock", "restore_marker"]

LOCK_FILE = ".lock"
RESTORE_MARKER = ".restore.json"


def restore_marker(tree_dir) -> str:
    """The path of the marker an interrupted restore leaves in ``tree_dir``."""
    return os.path.join(tree_dir, RESTORE_MARKER)


def acquire_lock(dirpath):
    """Take the tree's writer lock (``flock`` on ``.lock``, non-blocking); returns its descriptor."""
    path = os.path.join(dirpath, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        raise os_error(exc, path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise MCFIOError(errno.EBUSY, "the tree is already open for writing (one writer at a time)",
                             dirpath) from None
        raise os_error(exc, path) from None
    return fd
