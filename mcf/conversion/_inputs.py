"""The inputs of a tokenize run: local files, or URLs read through :mod:`mcf.remote` (``s3://``, ``gs://``,
``az://``, ``http(s)://`` and fsspec's other schemes).

A URL is read as a stream of large buffered reads over a :class:`mcf.remote.RemoteFile`: each refill of the
buffer (``REMOTE_BUFFER_BYTES``) is one plan of ranged GETs, several in flight, checked and retried as every
remote read is, and pinned to the object's version seen at opening (an object replaced while it is read is
an error, never a mix of two versions).  Its size, the progress total, comes from the store before the
output is created, so a missing object or refused credentials stop the run before anything is written.
"""

from __future__ import annotations

import io
import os
import stat

from mcf._core.fs import not_regular
from mcf.errors import os_error
from mcf.remote import is_url

__all__ = ["input_size", "open_input", "REMOTE_BUFFER_BYTES"]

#: bytes fetched per refill when a URL is read (four 8 MiB requests in flight)
REMOTE_BUFFER_BYTES = 32 << 20


def _remote(url: str, storage_options):
    from mcf.remote import RemoteFile

    return RemoteFile(url) if storage_options is None else RemoteFile(url, storage_options=storage_options)


def input_size(path: str, storage_options=None) -> int:
    """The size of the input ``path`` in bytes: a regular file's (a FIFO or a device is refused, naming it),
    or the object's at a URL."""
    if is_url(path):
        f = _remote(path, storage_options)
        try:
            return f.size
        finally:
            f.close()
    try:
        st = os.stat(path)
    except OSError as exc:
        raise os_error(exc, path) from None
    if not stat.S_ISREG(st.st_mode):  # refused before the output is created (a FIFO would block)
        raise not_regular(path, st.st_mode)
    return st.st_size


class _Raw(io.RawIOBase):
    """A :class:`mcf.remote.RemoteFile` as the raw stream under an ``io.BufferedReader``."""

    def __init__(self, f):
        super().__init__()
        self._f = f
        self.name = f.name      # redacted

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._f.readinto(b)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def open_input(path: str, storage_options=None):
    """A buffered binary stream over the URL ``path`` (with ``peek``, ``tell`` and ``close``); None for a local
    path, which the reader opens itself."""
    if not is_url(path):
        return None
    return io.BufferedReader(_Raw(_remote(path, storage_options)), buffer_size=REMOTE_BUFFER_BYTES)
