# cython: freethreading_compatible = False
"""The one I/O core every format of mcf reads through.

A :class:`Source` is a read-only, bounds-checked window on the bytes of one file, in one of four modes:

- ``mmap``: the file is mapped once; :meth:`Source.view` returns zero-copy numpy arrays.  The mapping
  is owned by a small ``_Mapping`` object that every view references, so :meth:`Source.close` only
  drops the source's own reference: views handed out earlier stay valid and the mapping is unmapped
  when the last of them dies (the crash of numpy issues #9537/#9562 cannot happen).  The mapping is
  shared and read-only, so views are read-only arrays that refuse ``setflags(write=True)``;
  :meth:`Source.cow_view` gives writable zero-copy views of a second, private copy-on-write mapping for
  callers such as torch that ignore numpy's read-only flag.
- ``pread``: positional reads with the GIL released into page-aligned buffers, for file systems where
  mapping is slow or forbidden (network and FUSE filesystems, the MCF spec's "mmap must be optional").
- ``fileobj``: any binary file-like object with ``seek`` and ``readinto`` (or ``read``), e.g. fsspec.
- ``memory``: any bytes-like object already in memory (tests, fuzzers, network payloads).

Every read checks ``offset`` and ``size`` against the file size with Python integers, before any
C arithmetic, so no caller value can wrap around.

``mmap=None`` (every reader's default) picks the mode from the filesystem the file is on
(:mod:`mcf._core.storage`): mapped on local disks, ``pread`` on network and FUSE filesystems, where
page faults are round trips to a server and a vanished server is a SIGBUS.

Plans of many ranges (:meth:`Source.read_into`, :meth:`Source.read_ranges`, and large reads in ``pread``
mode) go through the read engine (``csrc/readengine.c``): every range and destination is checked here,
then one call without the GIL sorts and coalesces the plan, cuts it into chunks and reads them with a
pool of pthreads straight into the destinations, with the workers and chunk size of the storage's kind
unless the caller says otherwise.
"""

import os
import threading

import numpy as np

from libc.stdint cimport uint8_t, uint64_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy
from libc.errno cimport errno, EINTR, ENOMEM
from posix.types cimport off_t
from posix.unistd cimport pread, close as _close_fd
from posix.mman cimport (mmap, munmap, madvise, MAP_FAILED, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_PRIVATE,
                         MADV_NORMAL, MADV_RANDOM, MADV_SEQUENTIAL, MADV_WILLNEED, MADV_DONTNEED)

cdef extern from "platform.h" nogil:
    # a private mapping's copy-on-write pages are not reserved up front: mapping a checkpoint larger than
    # RAM + swap must not fail with ENOMEM when the caller writes to a few tensors at most
    enum: MAP_NORESERVE
    # which filesystem holds a descriptor: Linux's statfs magic, or macOS's type name
    int mcf_fs_of_fd(int fd, unsigned long* magic, char* name, size_t cap)
from cpython.buffer cimport PyBuffer_FillInfo, PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE

cdef extern from "readengine.h" nogil:
    ctypedef struct mcf_read_range:
        uint64_t offset
        uint64_t size
        uint8_t* dst
    ctypedef struct mcf_read_config:
        int fd
        int direct_fd
        unsigned threads
        uint64_t chunk
        uint64_t align
        int streams
    ctypedef struct mcf_read_result:
        int error
        int truncated
        uint64_t fail_offset
        uint64_t bytes
        uint64_t requests
        uint64_t ranges
        unsigned threads
        int direct
        int direct_refused
        unsigned streams
        unsigned steals
    int mcf_read_plan(mcf_read_range* ranges, size_t n, const mcf_read_config* cfg, mcf_read_result* res)
    int mcf_plan_overlap(const mcf_read_range* ranges, size_t n, size_t* first, size_t* second)

cimport numpy as cnp
from cpython.ref cimport Py_INCREF

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # steals a reference to `descr`
    object PyArray_NewFromDescr(type subtype, cnp.dtype descr, int nd, cnp.npy_intp* dims,
                                cnp.npy_intp* strides, void* data, int flags, object obj)

from mcf._core.args import integer, integers
from mcf._core.fs import not_regular, open_regular
from mcf._core.redaction import redact
from mcf._core.urls import is_url
from mcf._core.storage import ReadStats, Storage, defaults_for, storage_for_magic, storage_for_name
from mcf.errors import (ArgumentTypeError, ClosedError, InvalidArgumentError, MCFIOError, OutOfBoundsError,
                        TruncatedError, os_error)

__all__ = ["Source", "open_source", "open_fd", "storage_of", "aligned_empty", "alloc_buffer", "PAGE_SIZE",
           "MAX_THREADS", "MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "DIRECT_ALIGN"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Linux transfers at most 0x7ffff000 bytes per read call.
cdef size_t _MAX_IO = 0x40000000

# The read engine's limits: more workers than this is a mistake, not a setting (each is a thread); a
# chunk below a page costs a system call per page, above 1 GiB it is more than one read call anyway.
MAX_THREADS = 256
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 1 << 30
# a single copy this large may go through the engine (two chunks of the smallest default chunk size)
cdef size_t _ENGINE_MIN_COPY = 4 << 20
# O_DIRECT requests start, end and land on this boundary: the largest logical block size of common
# devices (512 and 4096); a device that needs more refuses with EINVAL and the engine reads buffered.
DIRECT_ALIGN = 4096

_ADVICE = {
    "normal": MADV_NORMAL,
    "random": MADV_RANDOM,
    "sequential": MADV_SEQUENTIAL,
    "willneed": MADV_WILLNEED,
    "dontneed": MADV_DONTNEED,
}


def alloc_buffer(nbytes):
    """A fresh, writable uint8 array of ``nbytes`` starting on a page boundary (see :func:`aligned_empty`).
    Reads into page-aligned memory run about twice as fast as into unaligned memory."""
    return aligned_empty(nbytes, 4096)


cdef extern from "stdlib.h" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)


cdef class _Block:
    """Owns one block of the C allocator's memory, exported writable through the buffer protocol; freed
    when the last array over it dies."""
    cdef void* ptr
    cdef Py_ssize_t size

    def __cinit__(self, Py_ssize_t size, size_t alignment):
        self.ptr = NULL
        self.size = size
        if posix_memalign(&self.ptr, alignment, <size_t>(size if size > 0 else 1)) != 0:
            self.ptr = NULL
            raise MemoryError(f"cannot allocate {size} bytes")

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        PyBuffer_FillInfo(buffer, self, self.ptr, self.size, 0, flags)

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    def __dealloc__(self):
        free(self.ptr)
        self.ptr = NULL


def aligned_empty(nbytes, align=4096):
    """A fresh uint8 array of ``nbytes`` whose data starts on an ``align``-byte boundary.

    The memory comes from the C allocator (``posix_memalign``), as torch's does, and not from numpy's,
    which asks the kernel for transparent huge pages (``MADV_HUGEPAGE``) on every array of 4 MiB or more.
    What a fresh array costs is its first-touch page faults, paid while the read engine fills it, and on
    this project's machine (a Firecracker VM whose balloon takes back free memory) huge pages made them
    3-4x dearer: a 1.67 GB load spent ~2.9 s of system time faulting huge pages against ~0.8 s for 4 KiB
    pages, and loaded at 0.3 GB/s instead of 1 GB/s from the page cache (bench/results/loading.md).  The
    kernel's own policy still applies: with transparent huge pages ``always``, these arrays get them too;
    and a block the C allocator recycles from heap memory numpy advised earlier keeps that advice.
    """
    nbytes = int(nbytes)
    align = int(align)
    if nbytes < 0:
        raise InvalidArgumentError("nbytes must be >= 0")
    if align < 1:
        raise InvalidArgumentError("align must be >= 1")
    cdef bint power = align & (align - 1) == 0
    # posix_memalign takes powers of two of at least a pointer's size; any other alignment is found
    # inside a block that much larger
    block = _Block(nbytes if power else nbytes + align, max(align, sizeof(void*)) if power else sizeof(void*))
    buf = np.frombuffer(block, dtype=np.uint8)
    start = (-buf.ctypes.data) % align
    return buf[start:start + nbytes]


cdef class _Mapping:
    """Owns one mapping; exports it through the buffer protocol (read-only, or writable for a private
    copy-on-write mapping); unmaps on last release."""

    def __cinit__(self):
        self.addr = NULL
        self.length = 0
        self.writable = False

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        PyBuffer_FillInfo(buffer, self, self.addr, <Py_ssize_t>self.length, 0 if self.writable else 1, flags)

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    def __dealloc__(self):
        if self.addr != NULL:
            munmap(self.addr, self.length)
            self.addr = NULL


cdef int _get_writable(object buffer, Py_buffer* view) except -1:
    try:
        PyObject_GetBuffer(buffer, view, PyBUF_SIMPLE | PyBUF_WRITABLE)
    except (BufferError, TypeError, ValueError):   # numpy refuses a read-only array with ValueError
        raise InvalidArgumentError(
            f"expected a writable contiguous buffer, got {type(buffer).__name__}") from None
    return 0


cdef _Mapping _map_fd(int fd, uint64_t size, object name, bint private=False):
    """The whole file mapped: shared and read-only (arrays over it are read-only and refuse
    ``setflags(write=True)``: a write would be a SIGSEGV), or ``private``: readable and writable, every
    written page copied for this process alone, the file never changed (:meth:`Source.cow_view`).
    ``MAP_NORESERVE`` keeps a private mapping of a checkpoint larger than RAM + swap possible."""
    cdef _Mapping m = _Mapping.__new__(_Mapping)
    cdef void* p
    cdef int prot = PROT_READ | PROT_WRITE if private else PROT_READ
    cdef int flags = MAP_PRIVATE | MAP_NORESERVE if private else MAP_SHARED
    m.writable = private
    if size == 0:
        return m
    if size > <uint64_t>(<size_t>-1):
        raise MCFIOError(0, "file too large to map on this platform", name)
    with nogil:
        p = mmap(NULL, <size_t>size, prot, flags, fd, 0)
    if p == MAP_FAILED:
        raise os_error(OSError(errno, os.strerror(errno)), name)
    m.addr = p
    m.length = <size_t>size
    return m


cdef ssize_t _pread_full(int fd, uint8_t* dst, size_t n, uint64_t offset, int* err) noexcept nogil:
    """Read exactly n bytes at offset unless the file ends or fails first; returns the bytes read and
    sets *err to errno on failure.  Loops over short reads, EINTR and the kernel's per-call cap."""
    cdef size_t done = 0, want
    cdef ssize_t got
    err[0] = 0
    while done < n:
        want = n - done
        if want > _MAX_IO:
            want = _MAX_IO
        got = pread(fd, dst + done, want, <off_t>(offset + done))
        if got < 0:
            if errno == EINTR:
                continue
            err[0] = errno
            break
        if got == 0:
            break
        done += <size_t>got
    return <ssize_t>done


cdef class Source:
    """A bounds-checked, read-only byte source (see the module docstring for the modes)."""

    def __cinit__(self):
        self._fd = -1
        self._closed = True
        self.base = NULL
        self._size = 0
        self._owns_fileobj = False
        self._inflight = 0
        self._release_pending = False
        self._dfd = -1

    def __init__(self):
        raise ArgumentTypeError("use mcf.io.open_source() to create a Source")

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def _from_path(path, use_mmap):
        # a FIFO, a socket or a device is refused before it is opened (a FIFO's open waits for a writer,
        # forever), and the opened descriptor is checked again (mcf._core.fs.open_regular)
        fspath = os.fspath(path)
        return Source._from_fd(open_regular(fspath), fspath, use_mmap)

    @staticmethod
    def _from_fd(int fd, path, use_mmap):
        """A source over ``fd`` (an open, readable descriptor), which it owns from here on: closed with
        the source, or at once when it is refused (not a regular file, or the mapping fails).
        ``use_mmap`` None maps the file when its filesystem is local (:mod:`mcf._core.storage`)."""
        cdef Source s = Source.__new__(Source)
        s.path = path
        s.name = os.fsdecode(path) if path is not None else f"<fd {fd}>"
        s._fd = fd
        try:
            st = os.fstat(s._fd)
        except OSError as exc:
            os.close(s._fd)
            s._fd = -1
            raise os_error(exc, s.name) from None
        import stat as _stat
        if not _stat.S_ISREG(st.st_mode):
            os.close(s._fd)
            s._fd = -1
            raise not_regular(s.name, st.st_mode)
        s._size = st.st_size
        s._closed = False
        s._lock = threading.Lock()
        s._storage = _fd_storage(fd)
        if use_mmap is None:
            use_mmap = defaults_for(s._storage.kind).mmap
        if use_mmap:
            s.mode = "mmap"
            try:
                s._set_mapping(_map_fd(s._fd, s._size, s.name))
            except BaseException:
                os.close(s._fd)
                s._fd = -1
                s._closed = True
                raise
        else:
            s.mode = "pread"
        return s

    @staticmethod
    def from_fileobj(fileobj, bint owns=False):
        """A source over a binary file-like object with ``seek`` and ``readinto`` (or ``read``); with ``owns``
        the source closes it when it closes (what :func:`mcf.remote.open_remote` does with a RemoteFile)."""
        cdef Source s = Source.__new__(Source)
        if not hasattr(fileobj, "seek") or not (hasattr(fileobj, "readinto") or hasattr(fileobj, "read")):
            raise ArgumentTypeError("a file-like source needs seek() and readinto() or read()")
        s._fileobj = fileobj
        s._owns_fileobj = owns
        s.path = None
        s.name = str(getattr(fileobj, "name", None) or getattr(fileobj, "path", None) or repr(fileobj))
        s.mode = "fileobj"
        s._lock = threading.Lock()
        try:
            end = fileobj.seek(0, os.SEEK_END)
            if end is None:
                end = fileobj.tell()
        except OSError as exc:
            raise os_error(exc, s.name) from None
        s._size = int(end)
        s._closed = False
        return s

    @staticmethod
    def _from_memory(data, name=None):
        cdef Source s = Source.__new__(Source)
        mv = memoryview(data).cast("B")
        if not mv.contiguous:
            raise InvalidArgumentError("memory source must be contiguous")
        s._mapping = mv
        s.path = None
        s.name = name if name is not None else "<memory>"
        s.mode = "memory"
        s._size = mv.nbytes
        s._lock = threading.Lock()
        s._closed = False
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
        if arr.flags.writeable:
            arr = arr.view()
            arr.flags.writeable = False
        s._whole = arr
        if mv.nbytes:
            s.base = <const uint8_t*><uintptr_t>arr.ctypes.data
        return s

    cdef _set_mapping(self, _Mapping m):
        self._mapping = m
        self.base = <const uint8_t*>m.addr
        if m.length:
            self._whole = np.frombuffer(m, dtype=np.uint8)
        else:
            self._whole = np.empty(0, dtype=np.uint8)
            self._whole.flags.writeable = False

    # -- properties ---------------------------------------------------------------------------
    @property
    def bytes_read(self):
        """Bytes this source has fetched from its storage so far (reads and copies; zero-copy views of a
        mapping read nothing until touched and are not counted): what a partial load is held to."""
        return self._bytes_read

    @property
    def storage(self):
        """Where the file lives (:class:`mcf._core.storage.Storage`: kind, filesystem, statfs magic), which
        decides the defaults of ``mmap``, ``threads`` and ``chunk_bytes``; None for file-like and memory
        sources."""
        return self._storage

    @property
    def read_stats(self):
        """What the read engine did in this source's last plan read (:class:`mcf._core.storage.ReadStats`:
        storage, threads, chunk_bytes, direct, ranges, requests, bytes_read), for loaders to report;
        None before the first one, and for file-like and memory sources, which do not use the engine."""
        return self._read_stats

    @property
    def version(self):
        """What tells this file from another of the same name and size, for a check that several processes
        (the ranks of a distributed load) read the same bytes: for a file, ``fstat``'s answer now as a dict
        (``size``, ``mtime_ns``, ``device``, ``inode``); for a file-like object, its own ``version`` (a URL's
        ``etag`` and ``modified``, pinned at opening: :attr:`mcf.remote.RemoteFile.version`) or None; None
        for memory."""
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        if self.mode == "memory":
            return None
        if self.mode == "fileobj":
            return getattr(self._fileobj, "version", None)
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            raise os_error(exc, self.name) from None
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "device": st.st_dev, "inode": st.st_ino}

    @property
    def size(self):
        """Size of the file in bytes (as of opening or the last :meth:`refresh`)."""
        return self._size

    def __len__(self):
        return self._size

    @property
    def closed(self):
        return self._closed

    @property
    def is_mapped(self):
        """True when :meth:`view` returns zero-copy arrays (``mmap`` and ``memory`` modes)."""
        return self.base != NULL or (self.mode in ("mmap", "memory"))

    def fileno(self):
        if self._fd < 0:
            raise MCFIOError(0, "source has no file descriptor", self.name)
        return self._fd

    def __repr__(self):
        state = "closed" if self._closed else f"{self._size} bytes"
        return f"<mcf Source {self.mode} {self.name!r} {state}>"

    # -- checks -------------------------------------------------------------------------------
    cdef int check_range(self, object offset, object size) except -1:
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        if offset < 0 or size < 0 or offset > self._size or size > self._size - offset:
            raise OutOfBoundsError(
                f"{self.name}: read of {size} bytes at offset {offset} is outside the file "
                f"(size {self._size})")
        return 0

    def check(self, offset, size):
        """Raise :class:`OutOfBoundsError` unless ``[offset, offset+size)`` lies inside the file."""
        self.check_range(integer(offset, "offset"), integer(size, "size"))

    # -- reads --------------------------------------------------------------------------------
    cdef int copy_to(self, uint64_t offset, size_t n, void* dst) except -1:
        """Copy ``n`` bytes at ``offset`` into ``dst``; the range must have been checked.  In ``pread``
        mode a read of two chunks or more goes through the read engine (requests in flight in parallel)."""
        cdef size_t done = 0
        cdef int fd = self._fd
        cdef int err = 0
        cdef const uint8_t* b = self.base
        cdef mcf_read_range one
        if n == 0:
            return 0
        if b != NULL:
            self.pin()
            try:
                with nogil:
                    memcpy(dst, b + offset, n)
            finally:
                self.unpin()
            self._bytes_read += n
            return 0
        if self.mode == "pread":
            # the size test comes first: per-item copies (Megatron, MegaContext) are far below any chunk
            if n >= _ENGINE_MIN_COPY:
                settings = self._settings(None, None, None, None)
                if n >= 2 * <size_t>settings[1]:
                    one.offset = offset
                    one.size = n
                    one.dst = <uint8_t*>dst
                    _engine(self, &one, 1, settings)
                    return 0
            self.pin()
            try:
                with nogil:
                    done = <size_t>_pread_full(fd, <uint8_t*>dst, n, offset, &err)
            finally:
                self.unpin()
            self._bytes_read += done
            if err:
                raise os_error(OSError(err, f"{os.strerror(err)} (read at offset {offset + done})"), self.name)
            if done < n:
                raise TruncatedError("file shrank while reading", path=self.name, offset=offset + done,
                                     expected=f"{n} bytes", got=f"{done} bytes")
            return 0
        # file-like object
        mv = memoryview(<uint8_t[:n]>(<uint8_t*>dst))
        self._fileobj_read(offset, mv)
        return 0

    cdef _fileobj_read(self, uint64_t offset, mv):
        cdef size_t n = len(mv), done = 0
        with self._lock:
            f = self._fileobj
            if f is None or self._closed:
                raise ClosedError(f"{self.name}: source is closed")
            before = _fetched(f)
            try:
                f.seek(offset)
                if hasattr(f, "readinto"):
                    while done < n:
                        k = f.readinto(mv[done:])
                        if not k:
                            break
                        done += k
                else:
                    while done < n:
                        chunk = f.read(n - done)
                        if not chunk:
                            break
                        mv[done:done + len(chunk)] = chunk
                        done += len(chunk)
            except OSError as exc:
                raise os_error(exc, self.name) from None
            finally:
                self._bytes_read += done if before is None else _fetched(f) - before
        if done < n:
            raise TruncatedError("file-like object returned fewer bytes than its size promised",
                                 path=self.name, offset=offset + done, expected=f"{n} bytes",
                                 got=f"{done} bytes")

    def read(self, offset, size):
        """Return ``size`` bytes at ``offset`` as ``bytes`` (a copy)."""
        offset = integer(offset, "offset")
        size = integer(size, "size")
        self.check_range(offset, size)
        if self.base != NULL:
            return bytes(self._whole[offset:offset + size])
        out = bytearray(size)
        cdef uint8_t[::1] mv
        if size:
            mv = out
            self.copy_to(offset, size, &mv[0])
        return bytes(out)

    def read_into(self, offsets, buffers, threads=None, chunk_bytes=None, *, direct=None, streams=None):
        """Fill every buffer of ``buffers`` (writable, contiguous: numpy arrays, memoryviews, the numpy
        view of a torch tensor) with the bytes at the matching entry of ``offsets``; returns the bytes
        the buffers hold.  Every range, every buffer and every argument is checked before any byte
        moves; buffers that overlap one another are refused (their bytes would depend on timing).

        The loaders' one entry into storage: a plan of byte ranges read by the engine straight into its
        destinations.  ``threads``, ``chunk_bytes``, ``direct`` (O_DIRECT) and ``streams`` (each worker
        reads one contiguous part through a descriptor of its own, instead of all workers taking the next
        request through one) default to the settings of the storage's kind (:mod:`mcf._core.storage`);
        :attr:`read_stats` tells what was used."""
        bufs = list(buffers)
        offs = integers(offsets, "offsets")
        cdef Py_ssize_t n = len(bufs), k, held = 0
        if offs.shape[0] != n:
            raise InvalidArgumentError(f"{offs.shape[0]} offsets for {n} buffers")
        settings = self._settings(threads, chunk_bytes, direct, streams)
        cdef const int64_t[::1] o = offs
        cdef Py_buffer* views = <Py_buffer*>calloc(n if n else 1, sizeof(Py_buffer))
        cdef mcf_read_range* rr = <mcf_read_range*>malloc((n if n else 1) * sizeof(mcf_read_range))
        cdef uint64_t total = 0
        try:
            if views == NULL or rr == NULL:
                raise MemoryError()
            if self._closed:
                raise ClosedError(f"{self.name}: source is closed")
            for k in range(n):
                _get_writable(bufs[k], &views[k])
                held = k + 1
                _plan_entry(self, rr, k, o[k], views[k].len, <uint8_t*>views[k].buf)
                total += rr[k].size
            _check_overlap(rr, n, f"{self.name}: read_into: buffers")
            _read_plan(self, rr, n, settings, threads is not None, chunk_bytes is not None)
        finally:
            for k in range(held):
                PyBuffer_Release(&views[k])
            free(views)
            free(rr)
        return total

    def readinto(self, offset, buffer):
        """Fill the whole of ``buffer`` (any writable contiguous buffer) from ``offset``."""
        offset = integer(offset, "offset")
        cdef Py_buffer view
        _get_writable(buffer, &view)
        try:
            n = view.len
            self.check_range(offset, n)
            self.copy_to(offset, <size_t>n, view.buf)
        finally:
            PyBuffer_Release(&view)
        return n

    def view(self, offset, size):
        """``size`` bytes at ``offset`` as a read-only uint8 array.

        Zero-copy when mapped (the array keeps the mapping alive); otherwise the bytes are read into a
        fresh page-aligned array.
        """
        offset = integer(offset, "offset")
        size = integer(size, "size")
        self.check_range(offset, size)
        if self.base != NULL or self.mode in ("mmap", "memory"):
            return self._whole[offset:offset + size]
        out = aligned_empty(size)
        cdef uint8_t[::1] mv
        if size:
            mv = out
            self.copy_to(offset, size, &mv[0])
        return out

    def cow_view(self, offset, size):
        """``size`` bytes at ``offset`` as a **writable** uint8 array whose writes never reach the file.

        Zero-copy when the source is a mapped file: the array lies in a second, private copy-on-write
        mapping of the file (made on first use, shared by every such view and kept alive by them), so
        nothing is read until it is touched and a write copies only the page it lands on, for this
        process alone.  Any other source (or a kernel that refuses the private mapping) gives a fresh
        copy.  This is what a torch tensor over file bytes needs: torch does not honour numpy's
        read-only flag, and a write through the shared read-only mapping would kill the process.
        """
        offset = integer(offset, "offset")
        size = integer(size, "size")
        self.check_range(offset, size)
        if self.mode == "mmap" and size:
            with self._lock:
                if self._cow is None:
                    self.pin()   # the descriptor stays open while it is mapped again
                    try:
                        self._cow = np.frombuffer(_map_fd(self._fd, self._size, self.name, True), dtype=np.uint8)
                    except MCFIOError:
                        self._cow = False   # refused (e.g. strict overcommit accounting): copies from here on
                    finally:
                        self.unpin()
                whole = self._cow
            if whole is not False:
                return whole[offset:offset + size]
        out = aligned_empty(size)
        if size:
            self.readinto(offset, out)
        return out

    def array(self, offset, dtype, shape):
        """An array of ``dtype`` and ``shape`` read at ``offset`` (zero-copy when mapped)."""
        dt = np.dtype(dtype)
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        shape = tuple(integer(d, "every dimension of shape") for d in shape)
        count = 1
        for d in shape:
            if d < 0:
                raise InvalidArgumentError(f"negative dimension in shape {shape}")
            count *= d
        nbytes = count * dt.itemsize
        offset = integer(offset, "offset")
        self.check_range(offset, nbytes)
        if self.base != NULL or self.mode in ("mmap", "memory"):
            if nbytes == 0:
                return np.empty(shape, dtype=dt)
            return np.ndarray(shape, dtype=dt, buffer=self._whole, offset=offset)
        return self.view(offset, nbytes).view(dt).reshape(shape)

    def _typed_view(self, uint64_t offset, uint64_t nbytes, cnp.dtype dtype, tuple shape):
        """Fast path for readers that already validated (offset, nbytes, dtype, shape) against the
        file: one array of ``dtype`` and ``shape`` at ``offset``.  The range and the size are still
        checked here; only the error messages are left to the callers' earlier validation."""
        cdef int nd = len(shape)
        cdef cnp.npy_intp dims[32]
        cdef uint64_t count = 1, d
        cdef Py_ssize_t k
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        if nd > 32:
            raise InvalidArgumentError("too many dimensions")
        for k in range(nd):
            d = shape[k]
            if d > <uint64_t>0x7fffffffffffffff or (d and count > 0xffffffffffffffff // d):
                raise InvalidArgumentError("shape too large")
            count *= d
            dims[k] = <cnp.npy_intp>d
        if count > 0xffffffffffffffff // <uint64_t>dtype.itemsize or count * dtype.itemsize != nbytes:
            raise InvalidArgumentError(f"{nbytes} bytes do not hold {dtype} {shape}")
        if offset > self._size or nbytes > self._size - offset:
            raise OutOfBoundsError(
                f"{self.name}: read of {nbytes} bytes at offset {offset} is outside the file "
                f"(size {self._size})")
        if self.base == NULL:
            if self.mode in ("mmap", "memory"):  # empty file
                return np.empty(shape, dtype=dtype)
            return self.view(offset, nbytes).view(dtype).reshape(shape)
        Py_INCREF(dtype)  # PyArray_NewFromDescr steals a reference to the descriptor
        arr = PyArray_NewFromDescr(<type>np.ndarray, dtype, nd, dims, NULL,
                                       <void*>(self.base + offset), cnp.NPY_ARRAY_C_CONTIGUOUS, None)
        Py_INCREF(self._whole)  # PyArray_SetBaseObject steals a reference to the base
        cnp.PyArray_SetBaseObject(<cnp.ndarray>arr, self._whole)
        cnp.PyArray_UpdateFlags(<cnp.ndarray>arr, cnp.NPY_ARRAY_ALIGNED)
        return arr

    def read_ranges(self, offsets, sizes, out, out_offsets, threads=None, chunk_bytes=None, *, direct=None,
                    streams=None):
        """Copy many ranges of the file into one writable buffer, with the GIL released.

        ``offsets``/``sizes``/``out_offsets`` are equal-length integer sequences; every source range and
        every destination range is checked before any byte moves, and destination ranges that overlap
        are refused.  Files opened from a path are read by the read engine with ``pread`` (also in mmap
        mode: the kernel copies from the page cache without faulting the mapping in, and a cold file is
        read with many requests in flight); ``threads``, ``chunk_bytes``, ``direct`` and ``streams`` default
        to the storage's settings (:mod:`mcf._core.storage`; see :meth:`read_into`).
        """
        cdef Py_buffer view
        cdef Py_ssize_t k, n
        offs = integers(offsets, "offsets")
        szs = integers(sizes, "sizes")
        dsts = integers(out_offsets, "out_offsets")
        n = offs.shape[0]
        if szs.shape[0] != n or dsts.shape[0] != n:
            raise InvalidArgumentError("offsets, sizes and out_offsets must have the same length")
        settings = self._settings(threads, chunk_bytes, direct, streams)
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        cdef const int64_t[::1] o = offs
        cdef const int64_t[::1] z = szs
        cdef const int64_t[::1] d = dsts
        cdef mcf_read_range* rr = <mcf_read_range*>malloc((n if n else 1) * sizeof(mcf_read_range))
        if rr == NULL:
            raise MemoryError()
        try:
            _get_writable(out, &view)
            try:
                for k in range(n):
                    if d[k] < 0 or z[k] < 0 or d[k] > view.len or z[k] > view.len - d[k]:
                        raise OutOfBoundsError(
                            f"{self.name}: read_ranges: range {k} ({z[k]} bytes at {d[k]}) is outside the output "
                            f"buffer ({view.len} bytes)")
                    _plan_entry(self, rr, k, o[k], z[k], <uint8_t*>view.buf + d[k])
                _check_overlap(rr, n, f"{self.name}: read_ranges: destination ranges")
                _read_plan(self, rr, n, settings, threads is not None, chunk_bytes is not None)
            finally:
                PyBuffer_Release(&view)
        finally:
            free(rr)

    cdef object _settings(self, object threads, object chunk_bytes, object direct, object streams):
        """``(threads, chunk_bytes, direct, streams)`` of a plan read: the caller's values once checked,
        else the defaults of the storage's kind."""
        d = defaults_for(self._storage.kind if self._storage is not None else "unknown")
        if threads is None:
            t = d.threads
        else:
            t = integer(threads, "threads", minimum=1)
            if t > MAX_THREADS:
                raise InvalidArgumentError(f"threads must be <= {MAX_THREADS}, got {t}")
        if chunk_bytes is None:
            c = d.chunk_bytes
        else:
            c = integer(chunk_bytes, "chunk_bytes", minimum=MIN_CHUNK_BYTES)
            if c > MAX_CHUNK_BYTES:
                raise InvalidArgumentError(f"chunk_bytes must be <= {MAX_CHUNK_BYTES}, got {c}")
        if direct is None:
            dr = d.direct
        elif isinstance(direct, (bool, np.bool_)):
            dr = bool(direct)
        else:
            raise ArgumentTypeError(f"direct must be True, False or None, got {direct!r} ({type(direct).__name__})")
        if streams is None:
            sm = d.streams
        elif isinstance(streams, (bool, np.bool_)):
            sm = bool(streams)
        else:
            raise ArgumentTypeError(f"streams must be True, False or None, got {streams!r} "
                                    f"({type(streams).__name__})")
        return (t, c, dr, sm)

    cdef int _direct_fd(self) except -2:
        """The file again with O_DIRECT (opened once, through /proc/self/fd: no path to race with), or -1
        where the platform or the filesystem has none.  Call pinned."""
        if self._dfd == -1:
            with self._lock:
                if self._dfd == -1:
                    flag = getattr(os, "O_DIRECT", 0)
                    self._dfd = -2
                    if flag:
                        try:
                            self._dfd = os.open(f"/proc/self/fd/{self._fd}",
                                                os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
                        except OSError:   # EINVAL: the filesystem has none; no /proc: no way to reopen
                            pass
        return self._dfd if self._dfd >= 0 else -1

    def advise(self, advice, offset=0, size=None):
        """Pass a ``madvise`` hint for a range of a mapped file ("random", "sequential", "willneed",
        "dontneed", "normal").  A no-op for the other modes."""
        if advice not in _ADVICE:
            raise InvalidArgumentError(f"unknown advice {advice!r}; expected one of {sorted(_ADVICE)}")
        if self.mode != "mmap" or self.base == NULL:
            return
        offset = integer(offset, "offset")
        size = self._size - offset if size is None else integer(size, "size")
        self.check_range(offset, size)
        cdef uint64_t start = offset - offset % PAGE_SIZE
        cdef uint64_t length = offset + size - start
        cdef int adv = _ADVICE[advice]
        if length:
            madvise(<void*>(self.base + start), <size_t>length, adv)

    def refresh(self):
        """Pick up growth of a file another process appends to; returns the new size.

        Views from before stay valid (they keep the old mapping alive)."""
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        if self.mode == "memory":
            return self._size
        if self.mode == "fileobj":
            with self._lock:
                self._size = int(self._fileobj.seek(0, os.SEEK_END))
            return self._size
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            raise os_error(exc, self.name) from None
        if <uint64_t>st.st_size != self._size:
            if self.mode == "mmap":
                self._set_mapping(_map_fd(self._fd, st.st_size, self.name))
            self._size = st.st_size
        return self._size

    # -- lifetime -----------------------------------------------------------------------------
    def close(self):
        """Release the file.  Safe while views exist: they keep their mapping alive."""
        if self._closed:
            return
        self._closed = True
        self.base = NULL
        if self._inflight > 0:
            # copies in other threads still use the mapping or the descriptor (a closed fd number can
            # be reused by the next open(), and a pread on it would read another file): the last of
            # them releases both
            self._release_pending = True
            return
        self._release()

    cdef _release(self):
        self._release_pending = False
        self._mapping = None
        self._whole = None
        self._cow = None
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._fileobj is not None:
            with self._lock:
                if self._owns_fileobj:
                    self._fileobj.close()
                self._fileobj = None

    cdef int pin(self) except -1:
        """Called with the GIL before a copy that releases it: refuses a closed source, and keeps the
        mapping and the descriptor alive until the matching :meth:`unpin`."""
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        self._inflight += 1
        return 0

    cdef void unpin(self):
        self._inflight -= 1
        if self._inflight == 0 and self._release_pending:
            try:
                self._release()
            except BaseException:  # closing a descriptor cannot fail in a way a reader could act on
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        # A source nobody closed: this can run at interpreter exit after the module's globals (``os``)
        # and sys.stderr are gone, so it touches no Python object and cannot raise (an error here was
        # printed as "Exception ignored in Source.__dealloc__"): the C close(2) of the descriptors only.
        # A mapping is released by its own _Mapping, an owned file object by its own finalizer.
        if self._dfd >= 0:
            _close_fd(self._dfd)
            self._dfd = -1
        if self._fd >= 0:
            _close_fd(self._fd)
            self._fd = -1

    def __reduce__(self):
        # Pickling reopens the file in the receiving process (DataLoader workers, multiprocessing).
        if self.mode in ("mmap", "pread"):
            return (_reopen_path, (self.path, self.mode == "mmap"))
        if self.mode == "memory":
            return (_reopen_memory, (bytes(self._whole), self.name))
        return (_reopen_fileobj, (self._fileobj,))


def _reopen_path(path, use_mmap):
    return Source._from_path(path, use_mmap)


cdef object _fd_storage(int fd):
    """The :class:`Storage` of the filesystem holding ``fd`` (``unknown`` when statfs fails)."""
    cdef unsigned long magic = 0
    cdef char name[32]
    cdef int rc
    with nogil:
        rc = mcf_fs_of_fd(fd, &magic, name, sizeof(name))
    if rc != 0:
        return Storage("unknown", "?", None)
    if name[0]:
        return storage_for_name(name.decode("ascii", "replace"))
    return storage_for_magic(magic & 0xFFFFFFFF)


def storage_of(path):
    """Where ``path`` (a file or a directory) lives: a :class:`mcf._core.storage.Storage` with its kind
    (``local``, ``network``, ``fuse`` or ``unknown``), filesystem name and statfs magic number, which
    :func:`open_source` follows for ``mmap=None`` and the read engine for its defaults."""
    fspath = os.fspath(path)
    try:  # O_NONBLOCK: a FIFO's open would wait for a writer
        fd = os.open(fspath, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise os_error(exc, os.fsdecode(fspath)) from None
    try:
        return _fd_storage(fd)
    finally:
        os.close(fd)


cdef inline int _plan_entry(Source s, mcf_read_range* rr, Py_ssize_t k, int64_t offset, int64_t size,
                            uint8_t* dst) except -1:
    """Range ``k`` of a plan, once it lies inside the file (OutOfBoundsError naming it otherwise)."""
    if offset < 0 or size < 0 or <uint64_t>offset > s._size or <uint64_t>size > s._size - <uint64_t>offset:
        raise OutOfBoundsError(f"{s.name}: read of {size} bytes at offset {offset} (range {k}) is outside the file "
                               f"(size {s._size})")
    rr[k].offset = <uint64_t>offset
    rr[k].size = <uint64_t>size
    rr[k].dst = dst
    return 0


cdef int _check_overlap(const mcf_read_range* rr, Py_ssize_t n, what) except -1:
    """InvalidArgumentError when two non-empty destination ranges share a byte."""
    cdef size_t i = 0, j = 0
    cdef int rc = mcf_plan_overlap(rr, <size_t>n, &i, &j)
    if rc < 0:
        raise MemoryError()
    if rc:
        raise InvalidArgumentError(f"{what} {i} and {j} overlap in memory (each destination byte must belong "
                                   "to one range)")
    return 0


cdef object _fetched(f):
    """What a file-like object that fetches from a server (:class:`mcf.remote.RemoteFile`) says arrived so
    far, or None: for it, ``bytes_read`` counts the bytes that came over the network (a coalesced gap's and a
    retried answer's included; a cached block's not), not the bytes asked for."""
    return getattr(f, "bytes_fetched", None)


cdef object _read_plan(Source s, mcf_read_range* rr, Py_ssize_t n, object settings, bint threads_given,
                       bint chunk_given):
    """A checked plan read by the engine (file sources) or copied range by range (memory and file-like
    sources); returns the bytes fetched.  A file-like object that reads plans itself (``readinto_ranges``:
    :class:`mcf.remote.RemoteFile`) gets the caller's ``threads`` and ``chunk_bytes`` (``settings``) when
    they were given, as its requests in flight and their size, and keeps its own settings otherwise."""
    cdef Py_ssize_t k
    cdef const uint8_t* base = s.base
    cdef uint64_t total = 0
    if s._closed:
        raise ClosedError(f"{s.name}: source is closed")
    if s._fd >= 0:
        return _engine(s, rr, n, settings)
    for k in range(n):
        total += rr[k].size
    if base != NULL:
        s.pin()
        try:
            with nogil:
                for k in range(n):
                    memcpy(rr[k].dst, base + rr[k].offset, <size_t>rr[k].size)
        finally:
            s.unpin()
        s._bytes_read += total
        return total
    ks = [k for k in range(n) if rr[k].size]
    many = getattr(s._fileobj, "readinto_ranges", None)
    if many is not None:  # e.g. mcf.remote.RemoteFile: requests in flight across ranges
        with s._lock:
            if s._fileobj is None:
                raise ClosedError(f"{s.name}: source is closed")
            before = _fetched(s._fileobj)
            try:
                many([rr[k].offset for k in ks], [memoryview(<uint8_t[:rr[k].size]>rr[k].dst) for k in ks],
                     **{key: v for key, v, given in (("threads", settings[0], threads_given),
                                                     ("chunk_bytes", settings[1], chunk_given)) if given})
            except OSError as exc:
                if isinstance(exc, MCFIOError):
                    raise
                raise os_error(exc, s.name) from None
            finally:
                if before is not None:
                    total = _fetched(s._fileobj) - before
        s._bytes_read += total
        return total
    for k in ks:
        s._fileobj_read(rr[k].offset, memoryview(<uint8_t[:rr[k].size]>rr[k].dst))
    return total


cdef object _engine(Source s, mcf_read_range* rr, Py_ssize_t n, object settings):
    """One call of the read engine over a checked plan (reordered in place); returns the bytes the file
    returned."""
    cdef mcf_read_config cfg
    cdef mcf_read_result res
    cdef int rc
    threads, chunk, direct, streams = settings
    s.pin()
    try:
        cfg.fd = s._fd
        cfg.direct_fd = s._direct_fd() if direct else -1
        if cfg.direct_fd >= 0 and chunk % DIRECT_ALIGN:
            chunk += DIRECT_ALIGN - chunk % DIRECT_ALIGN
        cfg.threads = <unsigned>threads
        cfg.chunk = <uint64_t>chunk
        cfg.align = DIRECT_ALIGN
        cfg.streams = 1 if streams else 0
        with nogil:
            rc = mcf_read_plan(rr, <size_t>n, &cfg, &res)
    finally:
        s.unpin()
    s._bytes_read += res.bytes
    s._read_stats = ReadStats(s._storage, res.threads, chunk, res.direct != 0, res.ranges, res.requests, res.bytes,
                              res.streams)
    if rc:
        if res.truncated:
            raise TruncatedError("file shrank while reading", path=s.name, offset=res.fail_offset,
                                 expected=f"{s._size} bytes, its size when opened")
        if res.error == ENOMEM:
            raise MemoryError(f"{s.name}: no memory for the read engine's plan")
        raise os_error(OSError(res.error, f"{os.strerror(res.error)} (read at offset {res.fail_offset})"), s.name)
    return res.bytes


def _reopen_memory(data, name):
    return Source._from_memory(data, name)


def _reopen_fileobj(fileobj):
    return Source.from_fileobj(fileobj)


def open_fd(fd, name=None, mmap=None):
    """Open an already open file descriptor as a :class:`Source` (``mmap`` or ``pread`` mode; ``mmap=None``
    maps it when its filesystem is local, as :func:`open_source`).

    For callers that must open the file themselves: relative to a directory descriptor, with
    ``O_NOFOLLOW``, after checking what the descriptor is (:mod:`mcf.bucket` does all three).  The
    source owns ``fd`` from this call on and closes it with itself, also when it refuses it (not a
    regular file).  ``name`` names the file in error messages; pickling the source reopens ``name``
    as a path.
    """
    if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
        raise ArgumentTypeError(f"fd must be an open file descriptor (a non-negative int), got {fd!r}")
    return Source._from_fd(fd, os.fspath(name) if name is not None else None, _mmap_choice(mmap))


def _mmap_choice(mmap):
    if mmap is None or isinstance(mmap, (bool, np.bool_)):
        return None if mmap is None else bool(mmap)
    raise ArgumentTypeError(f"mmap must be True, False or None, got {mmap!r} ({type(mmap).__name__})")


def open_source(obj, mmap=None):
    """Open a local ``obj`` as a :class:`Source`: what :func:`mcf.io.open_source` does with everything but
    a URL (a path, a Source, bytes-like content, a file-like object; see there).  A URL string is refused
    here: the remote layer sits above the core, and :func:`mcf.io.open_source` opens URLs."""
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, bytes):
        if len(obj) < 4096 and b"\0" not in obj and os.path.exists(os.fsdecode(obj)):
            raise InvalidArgumentError(f"bytes are read as the file's content, but {obj!r} names an existing "
                                       "path: pass the path as str (os.fsdecode(path))")
        obj = memoryview(obj)
    if isinstance(obj, str) and is_url(obj):
        raise InvalidArgumentError(f"{redact(obj)}: a URL is opened by mcf.io.open_source (the core opens local "
                                   "sources only)")
    if isinstance(obj, (str, os.PathLike)):
        return Source._from_path(obj, _mmap_choice(mmap))
    if isinstance(obj, (bytearray, memoryview, np.ndarray)):
        return Source._from_memory(obj)
    if hasattr(obj, "seek"):
        return Source.from_fileobj(obj)
    raise ArgumentTypeError(f"cannot open {type(obj).__name__!r} as a byte source")
