"""The I/O core: one bounds-checked byte source (mmap, positional reads, file-like, memory) that every
format in mcf reads through.  See :class:`Source`.  URLs (``http(s)://``, ``s3://``...) open as file-like
sources over :class:`mcf.remote.RemoteFile` (range requests, block cache, checked lengths, retries)."""

from mcf._core._io import PAGE_SIZE, Source, aligned_empty, alloc_buffer, open_fd, open_source
from mcf.remote import RemoteFile, is_url, open_remote

__all__ = ["Source", "open_fd", "open_source", "aligned_empty", "alloc_buffer", "PAGE_SIZE", "RemoteFile",
           "is_url", "open_remote"]
