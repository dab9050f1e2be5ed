"""The I/O core: one bounds-checked byte source (mmap, positional reads, file-like, memory) that every
format in mcf reads through.  See :class:`Source`.  URLs (``http(s)://``, ``s3://``...) open as file-like
sources over :class:`mcf.remote.RemoteFile` (range requests, block cache, checked lengths, retries).

Plans of byte ranges (:meth:`Source.read_into`, :meth:`Source.read_ranges`) are read by the read engine,
whose defaults follow the storage a file lives on (:func:`storage_of`, :mod:`mcf._core.storage`)."""

from mcf._core._io import (DIRECT_ALIGN, MAX_CHUNK_BYTES, MAX_THREADS, MIN_CHUNK_BYTES, PAGE_SIZE, Source,
                           aligned_empty, alloc_buffer, open_fd, open_source, storage_of)
from mcf._core.storage import ReadDefaults, ReadStats, Storage
from mcf.remote import RemoteFile, is_url, open_remote

__all__ = ["Source", "open_fd", "open_source", "storage_of", "Storage", "ReadStats", "ReadDefaults", "aligned_empty",
           "alloc_buffer", "PAGE_SIZE", "MAX_THREADS", "MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "DIRECT_ALIGN",
           "RemoteFile", "is_url", "open_remote"]
