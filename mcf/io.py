"""The I/O core: one bounds-checked byte source (mmap, positional reads, file-like, memory) that every
format in mcf reads through.  See :class:`Source`.  URLs (``http(s)://``, ``s3://``...) open as file-like
sources over :class:`mcf.remote.RemoteFile` (range requests, block cache, checked lengths, retries).

Plans of byte ranges (:meth:`Source.read_into`, :meth:`Source.read_ranges`) are read by the read engine,
whose defaults follow the storage a file lives on (:func:`storage_of`, :mod:`mcf._core.storage`)."""

from mcf._core import _io
from mcf._core._io import (DIRECT_ALIGN, MAX_CHUNK_BYTES, MAX_THREADS, MIN_CHUNK_BYTES, PAGE_SIZE, Source,
                           aligned_empty, alloc_buffer, open_fd, storage_of)
from mcf._core.storage import ReadDefaults, ReadStats, Storage
from mcf.remote import is_url, open_remote

__all__ = ["Source", "open_fd", "open_source", "storage_of", "Storage", "ReadStats", "ReadDefaults", "aligned_empty",
           "alloc_buffer", "PAGE_SIZE", "MAX_THREADS", "MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "DIRECT_ALIGN",
           "RemoteFile", "is_url", "open_remote"]  # noqa: F822 - RemoteFile loads on first use (__getattr__)


def __getattr__(name):
    if name == "RemoteFile":   # loads the remote file's machinery only when it is asked for
        from mcf.remote.file import RemoteFile

        return RemoteFile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_source(obj, *, mmap=None) -> Source:
    """Open ``obj`` as a :class:`Source`.

    ``obj`` may be a path (``str`` or ``os.PathLike``), an existing :class:`Source` (returned as is),
    the file's content in memory (``bytes``, ``bytearray``, ``memoryview`` or a numpy array) read in
    place, or a binary file-like object with ``seek`` and ``readinto``/``read``.

    ``mmap=None`` (the default) follows the filesystem (:func:`storage_of`): a file on a local disk is
    mapped, one on a network or FUSE filesystem (NFS, SMB, Lustre, GPFS, CephFS, 9p, s3fs, gcsfuse...)
    is read with positional reads by the read engine, because page faults there are round trips to a
    server (and SIGBUS when it goes away).  ``mmap=True`` or ``False`` decides instead.

    ``bytes`` are content, never a path, for every reader alike (as ``safetensors.load`` and
    ``mcf.gguf.open`` take them): a path given as bytes would be ambiguous.  Decode such a path with
    ``os.fsdecode`` first.

    A URL string (``http(s)://``, ``s3://``, ``gs://``, ``memory://``, ``file://``..., anything fsspec
    knows) opens a ``fileobj`` source over :class:`mcf.remote.RemoteFile` (range requests, a block
    cache, checked lengths, bounded retries) whatever ``mmap`` says: remote bytes cannot be mapped.
    """
    if isinstance(obj, str) and is_url(obj):
        return open_remote(obj)
    return _io.open_source(obj, mmap)
