# The I/O core's C-level surface, for compiled modules (mcf's own batch gathers and kernels, and
# extensions built on mcf: docs/extending.md) that copy straight from a mapping without going through
# Python.  Public to those: base, check_range, copy_to, pin/unpin; the rest is mcf's own.
from libc.stdint cimport uint8_t, uint64_t, int64_t


cdef class _Mapping:
    cdef void* addr
    cdef size_t length
    cdef bint writable               # a private copy-on-write mapping (Source.cow_view), else read-only


cdef class Source:
    cdef readonly object name        # path as str, or repr of the wrapped object
    cdef readonly object path        # the path when opened from one, else None
    cdef readonly str mode           # "mmap", "pread", "fileobj" or "memory"
    cdef uint64_t _size
    cdef uint64_t _bytes_read        # fetched from storage so far (Source.bytes_read)
    cdef int _fd
    cdef bint _closed
    cdef const uint8_t* base         # start of the bytes when mapped or in memory, else NULL
    cdef object _mapping             # _Mapping or memoryview that owns `base`
    cdef object _whole               # uint8 ndarray over all bytes (mapped/memory modes)
    cdef object _cow                 # Source.cow_view's private copy-on-write mapping as a writable uint8
                                     # ndarray, made on first use; False when the kernel refused it
    cdef object _fileobj
    cdef object _lock
    cdef bint _owns_fileobj
    cdef int _inflight               # copies running without the GIL (counted under the GIL)
    cdef bint _release_pending       # close() came while copies ran: the last one releases
    cdef int _dfd                    # the file again with O_DIRECT: -1 not opened yet, -2 refused
    cdef object _storage             # mcf._core.storage.Storage of a file source, else None
    cdef object _read_stats          # mcf._core.storage.ReadStats of the last engine call, or None

    # raise (OutOfBoundsError, ClosedError) unless [offset, offset+size) lies inside the open file
    cdef int check_range(self, object offset, object size) except -1
    # n bytes at a checked offset into dst; releases the GIL while it copies
    cdef int copy_to(self, uint64_t offset, size_t n, void* dst) except -1
    # with the GIL, around code that reads `base` without it: refuses a closed source (ClosedError), and
    # keeps the mapping alive until the matching unpin() even if another thread closes the source
    cdef int pin(self) except -1
    cdef void unpin(self)
    cdef _release(self)
    cdef _set_mapping(self, _Mapping m)
    cdef _fileobj_read(self, uint64_t offset, mv)
    # (threads, chunk_bytes, direct, streams) of a plan read: the caller's, checked, or the storage's defaults
    cdef object _settings(self, object threads, object chunk_bytes, object direct, object streams)
    cdef int _direct_fd(self) except -2
