"""The filesystem helpers of the MegaContext tree: its directory path, its level files, positioned writes.

Shared by the tree (opening, appending, committing) and its validation (scanning a directory); the
atomic-replace rules every writer follows live in :mod:`mcf._core.fs`.
"""

from __future__ import annotations

import errno
import os

import numpy as np

from mcf.errors import MCFIOError, MissingFileError, os_error
from mcf.megacontext._layout import LEVEL_FILES
from mcf.remote import is_url
from mcf.remote._urls import join_path, split_url

__all__ = ["dir_path", "level_path", "not_a_dir", "pwrite_all"]


def dir_path(path) -> str:
    """An absolute directory path, or a URL as given without a trailing ``/`` before its query (read-only trees
    over a URL, see mcf.remote)."""
    if is_url(path):
        head, query = split_url(os.fsdecode(path))
        return head.rstrip("/") + query
    return os.path.abspath(os.fspath(path))


def level_path(dirpath, level):
    """The path of level ``level``'s .ctx file in the tree directory ``dirpath`` (a URL's query kept after it)."""
    return join_path(dirpath, LEVEL_FILES[level])


def not_a_dir(path):
    """The error for a tree path that is not a directory: a file in the way, or nothing at all."""
    if os.path.exists(path):
        return MCFIOError(errno.ENOTDIR, "not a tree directory", path)
    return MissingFileError(errno.ENOENT, "no such tree directory", path)


def pwrite_all(fd, data, offset, path) -> None:
    """Write every byte of ``data`` (a buffer or any numpy array) at ``offset`` of ``fd`` (``os.pwrite`` may
    write less); OS errors are raised as :class:`mcf.MCFIOError` naming ``path``."""
    if isinstance(data, np.ndarray):
        data = data.reshape(-1).view(np.uint8)   # any dtype (ml_dtypes' bfloat16 has no buffer format)
    view = memoryview(data).cast("B")
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n
    except OSError as exc:
        raise os_error(exc, path) from None
