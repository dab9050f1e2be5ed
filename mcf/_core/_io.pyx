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
  mapping is slow or forbidden (parallel file systems, the MCF spec's "mmap must be optional").
- ``fileobj``: any binary file-like object with ``seek`` and ``readinto`` (or ``read``), e.g. fsspec.
- ``memory``: any bytes-like object already in memory (tests, fuzzers, network payloads).

Every read checks ``offset`` and ``size`` against the file size with Python integers, before any
C arithmetic, so no caller value can wrap around.
"""

import os
import threading

import numpy as np

from libc.stdint cimport uint8_t, uint64_t, int64_t, uintptr_t
from libc.string cimport memcpy
from libc.errno cimport errno, EINTR
from posix.types cimport off_t
from posix.unistd cimport pread
from posix.mman cimport (mmap, munmap, madvise, MAP_FAILED, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_PRIVATE,
                         MADV_NORMAL, MADV_RANDOM, MADV_SEQUENTIAL, MADV_WILLNEED, MADV_DONTNEED)

cdef extern from "sys/mman.h":
    # a private mapping's copy-on-write pages are not reserved up front: mapping a checkpoint larger than
    # RAM + swap must not fail with ENOMEM when the caller writes to a few tensors at most
    enum: MAP_NORESERVE
from cpython.buffer cimport PyBuffer_FillInfo, PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE

cimport numpy as cnp
from cpython.ref cimport Py_INCREF

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # steals a reference to `descr`
    object PyArray_NewFromDescr(type subtype, cnp.dtype descr, int nd, cnp.npy_intp* dims,
                                cnp.npy_intp* strides, void* data, int flags, object obj)

from mcf._core.args import integer, integers
from mcf.errors import (ArgumentTypeError, ClosedError, InvalidArgumentError, MCFIOError, OutOfBoundsError,
                        TruncatedError, os_error)

__all__ = ["Source", "open_source", "aligned_empty", "alloc_buffer", "PAGE_SIZE"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Linux transfers at most 0x7ffff000 bytes per read call.
cdef size_t _MAX_IO = 0x40000000

_ADVICE = {
    "normal": MADV_NORMAL,
    "random": MADV_RANDOM,
    "sequential": MADV_SEQUENTIAL,
    "willneed": MADV_WILLNEED,
    "dontneed": MADV_DONTNEED,
}


def alloc_buffer(nbytes):
    """A fresh, writable uint8 array of ``nbytes`` starting on a page boundary.

    numpy's allocator is used on purpose: it asks the kernel for transparent huge pages on large
    arrays and glibc reuses freed memory, which measured faster and far steadier here than fresh
    anonymous mappings with ``MADV_HUGEPAGE`` (those stall in direct compaction under the kernel's
    ``defrag=madvise`` setting).  Reads into page-aligned memory run about twice as fast as into
    unaligned memory.
    """
    return aligned_empty(nbytes, 4096)


def aligned_empty(nbytes, align=4096):
    """A fresh uint8 array of ``nbytes`` whose data starts on an ``align``-byte boundary."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise InvalidArgumentError("nbytes must be >= 0")
    if align < 1:
        raise InvalidArgumentError("align must be >= 1")
    buf = np.empty(nbytes + align, dtype=np.uint8)
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
    except (BufferError, TypeError):
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

    def __init__(self):
        raise ArgumentTypeError("use mcf.io.open_source() to create a Source")

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def _from_path(path, bint use_mmap):
        fspath = os.fspath(path)
        try:
            fd = os.open(fspath, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise os_error(exc, os.fsdecode(fspath)) from None
        return Source._from_fd(fd, fspath, use_mmap)

    @staticmethod
    def _from_fd(int fd, path, bint use_mmap):
        """A source over ``fd`` (an open, readable descriptor), which it owns from here on: closed with
        the source, or at once when it is refused (not a regular file, or the mapping fails)."""
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
            raise MCFIOError(0, "not a regular file", s.name)
        s._size = st.st_size
        s._closed = False
        s._lock = threading.Lock()
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
    def _from_fileobj(fileobj, bint owns=False):
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
        """Copy ``n`` bytes at ``offset`` into ``dst``; the range must have been checked."""
        cdef size_t done = 0
        cdef int fd = self._fd
        cdef int err = 0
        cdef const uint8_t* b = self.base
        if n == 0:
            return 0
        self._bytes_read += n
        if b != NULL:
            self.pin()
            try:
                with nogil:
                    memcpy(dst, b + offset, n)
            finally:
                self.unpin()
            return 0
        if self.mode == "pread":
            self.pin()
            try:
                with nogil:
                    done = <size_t>_pread_full(fd, <uint8_t*>dst, n, offset, &err)
            finally:
                self.unpin()
            if err:
                raise os_error(OSError(err, os.strerror(err)), self.name)
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

    def read_into(self, offsets, buffers, threads=None, chunk_bytes=None):
        """Fill every buffer of ``buffers`` (writable, contiguous: numpy arrays, memoryviews, the numpy
        view of a torch tensor) with the bytes at the matching entry of ``offsets``; returns the bytes
        read.  Every range is checked before any byte moves.

        The loaders' one entry into storage: a plan of byte ranges, each straight into its destination.
        ``threads`` and ``chunk_bytes`` tune the read engine (None: chosen for the storage)."""
        bufs = list(buffers)
        offs = integers(offsets, "offsets")
        if offs.shape[0] != len(bufs):
            raise InvalidArgumentError(f"{offs.shape[0]} offsets for {len(bufs)} buffers")
        cdef Py_buffer view
        sizes = []
        for k, buf in enumerate(bufs):
            _get_writable(buf, &view)
            sizes.append(view.len)
            PyBuffer_Release(&view)
            self.check_range(int(offs[k]), sizes[k])
        total = 0
        for k, buf in enumerate(bufs):
            total += self.readinto(int(offs[k]), buf)
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

    def read_ranges(self, offsets, sizes, out, out_offsets, threads=1):
        """Copy many ranges of the file into one writable buffer, with the GIL released.

        ``offsets``/``sizes``/``out_offsets`` are equal-length integer sequences; every source range
        and every destination range is checked before any byte moves.  Files opened from a path are
        read with ``pread`` (also in mmap mode: the kernel copies from the page cache without
        faulting the mapping in); ``threads`` > 1 splits the ranges by bytes across threads.
        """
        cdef Py_buffer view
        cdef Py_ssize_t k, n
        offs = integers(offsets, "offsets")
        szs = integers(sizes, "sizes")
        dsts = integers(out_offsets, "out_offsets")
        n = offs.shape[0]
        if szs.shape[0] != n or dsts.shape[0] != n:
            raise InvalidArgumentError("offsets, sizes and out_offsets must have the same length")
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        _get_writable(out, &view)
        try:
            if n:
                if (offs < 0).any() or (szs < 0).any() or (dsts < 0).any():
                    raise OutOfBoundsError(f"{self.name}: negative offset or size in read_ranges")
                # sizes and offsets are each < 2**63, so these sums cannot overflow uint64
                if ((offs.astype(np.uint64) + szs.astype(np.uint64) > np.uint64(self._size)).any()):
                    k = int(np.flatnonzero(offs.astype(np.uint64) + szs.astype(np.uint64)
                                           > np.uint64(self._size))[0])
                    raise OutOfBoundsError(
                        f"{self.name}: read of {szs[k]} bytes at offset {offs[k]} is outside the file "
                        f"(size {self._size})")
                if (dsts.astype(np.uint64) + szs.astype(np.uint64) > np.uint64(view.len)).any():
                    raise OutOfBoundsError("read_ranges: a destination range is outside the output buffer")
            if self.mode == "fileobj" or threads <= 1 or n < 2:
                self._copy_ranges(offs, szs, dsts, <uint8_t*>view.buf, 0, n)
            else:
                # split by bytes so the threads get similar work.  No negative index here: the module is
                # compiled with wraparound=False, which hands -1 to the sequence protocol unadjusted, and
                # numpy >= 2.5 no longer wraps it there (IndexError: index -11 ... size 10)
                cum = np.cumsum(szs)
                total = int(cum[n - 1])
                cuts = [0] + [int(np.searchsorted(cum, total * t // threads, side="left")) + 1
                              for t in range(1, threads)] + [int(n)]
                errors = []
                addr = <uintptr_t>view.buf

                def work(a, b):
                    try:
                        self._copy_ranges(offs, szs, dsts, <uint8_t*><uintptr_t>addr, a, b)
                    except BaseException as exc:  # re-raised in the caller
                        errors.append(exc)

                ts = [threading.Thread(target=work, args=(cuts[t], cuts[t + 1]))
                      for t in range(threads) if cuts[t] < cuts[t + 1]]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                if errors:
                    raise errors[0]
        finally:
            PyBuffer_Release(&view)

    cdef _copy_ranges(self, const int64_t[::1] offs, const int64_t[::1] szs, const int64_t[::1] dsts,
                      uint8_t* out, Py_ssize_t a, Py_ssize_t b):
        cdef Py_ssize_t k
        cdef int fd = self._fd
        cdef size_t done, n
        cdef int err = 0
        cdef Py_ssize_t bad = -1
        cdef const uint8_t* base = self.base
        if self._closed:
            raise ClosedError(f"{self.name}: source is closed")
        for k in range(a, b):
            self._bytes_read += <uint64_t>szs[k]
        if fd >= 0:
            self.pin()
            try:
                with nogil:
                    for k in range(a, b):
                        n = <size_t>szs[k]
                        done = <size_t>_pread_full(fd, out + dsts[k], n, <uint64_t>offs[k], &err)
                        if err or done < n:
                            bad = k
                            break
            finally:
                self.unpin()
            if err:
                raise os_error(OSError(err, os.strerror(err)), self.name)
            if bad >= 0:
                raise TruncatedError("file shrank while reading", path=self.name, offset=offs[bad],
                                     expected=f"{szs[bad]} bytes")
            return
        if base != NULL:
            self.pin()
            try:
                with nogil:
                    for k in range(a, b):
                        memcpy(out + dsts[k], base + offs[k], <size_t>szs[k])
            finally:
                self.unpin()
            return
        many = getattr(self._fileobj, "readinto_ranges", None)
        if many is not None:  # e.g. mcf.remote.RemoteFile: requests in flight across ranges
            ks = [k for k in range(a, b) if szs[k]]
            with self._lock:
                try:
                    many([offs[k] for k in ks], [memoryview(<uint8_t[:szs[k]]>(out + dsts[k])) for k in ks])
                except OSError as exc:
                    if isinstance(exc, MCFIOError):
                        raise
                    raise os_error(exc, self.name) from None
            return
        for k in range(a, b):
            if szs[k]:
                self._fileobj_read(<uint64_t>offs[k], memoryview(<uint8_t[:szs[k]]>(out + dsts[k])))

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
        if self._fd >= 0:
            os.close(self._fd)
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


def _reopen_memory(data, name):
    return Source._from_memory(data, name)


def _reopen_fileobj(fileobj):
    return Source._from_fileobj(fileobj)


def _is_url(obj):
    from mcf.remote import is_url
    return is_url(obj)


def open_fd(fd, name=None, mmap=True):
    """Open an already open file descriptor as a :class:`Source` (``mmap`` or ``pread`` mode).

    For callers that must open the file themselves: relative to a directory descriptor, with
    ``O_NOFOLLOW``, after checking what the descriptor is (:mod:`mcf.bucket` does all three).  The
    source owns ``fd`` from this call on and closes it with itself, also when it refuses it (not a
    regular file).  ``name`` names the file in error messages; pickling the source reopens ``name``
    as a path.
    """
    if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
        raise ArgumentTypeError(f"fd must be an open file descriptor (a non-negative int), got {fd!r}")
    return Source._from_fd(fd, os.fspath(name) if name is not None else None, bool(mmap))


def open_source(obj, mmap=True):
    """Open ``obj`` as a :class:`Source`.

    ``obj`` may be a path (``str`` or ``os.PathLike``), an existing :class:`Source` (returned as is),
    the file's content in memory (``bytes``, ``bytearray``, ``memoryview`` or a numpy array) read in
    place, or a binary file-like object with ``seek`` and ``readinto``/``read``.  ``mmap=False`` reads
    paths with positional reads instead of mapping them.

    ``bytes`` are content, never a path, for every reader alike (as ``safetensors.load`` and
    ``mcf.gguf.open`` take them): a path given as bytes would be ambiguous.  Decode such a path with
    ``os.fsdecode`` first.

    A URL string (``http(s)://``, ``s3://``, ``gs://``, ``memory://``, ``file://``..., anything fsspec
    knows) opens a ``fileobj`` source over :class:`mcf.remote.RemoteFile` (range requests, a block
    cache, checked lengths, bounded retries) whatever ``mmap`` says: remote bytes cannot be mapped.
    """
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, bytes):
        if len(obj) < 4096 and b"\0" not in obj and os.path.exists(os.fsdecode(obj)):
            raise InvalidArgumentError(f"bytes are read as the file's content, but {obj!r} names an existing "
                                       "path: pass the path as str (os.fsdecode(path))")
        obj = memoryview(obj)
    if isinstance(obj, str) and _is_url(obj):
        from mcf.remote import open_remote
        return open_remote(obj)
    if isinstance(obj, (str, os.PathLike)):
        return Source._from_path(obj, bool(mmap))
    if isinstance(obj, (bytearray, memoryview, np.ndarray)):
        return Source._from_memory(obj)
    if hasattr(obj, "seek"):
        return Source._from_fileobj(obj)
    raise ArgumentTypeError(f"cannot open {type(obj).__name__!r} as a byte source")
