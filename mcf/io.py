"""The I/O core: one bounds-checked byte source (mmap, positional reads, file-like, memory) that every
format in mcf reads through.  See :class:`Source`."""

from mcf._io import PAGE_SIZE, Source, aligned_empty, alloc_buffer, open_source

__all__ = ["Source", "open_source", "aligned_empty", "alloc_buffer", "PAGE_SIZE"]
