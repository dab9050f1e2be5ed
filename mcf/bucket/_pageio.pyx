# cython: language_level=3
"""The pages area's compiled part (csrc/pageio.c): CRC-32C in its variants, and whole batches of page
reads, writes and existence checks, each one call that runs without the GIL on a few threads.

This module moves bytes and computes checksums; what they mean (the header, the key, damage, TTL, the warm
tier) is mcf/bucket/pages.py's.  Every buffer is held (PyObject_GetBuffer) for the length of the call."""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from mcf._core._fpconv cimport resolve_impl
from mcf._core._kernel_args cimport thread_count

from mcf.errors import ArgumentTypeError, InvalidArgumentError


cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "cpu.h" nogil:
    const char *mcf_impl_name(int impl)

cdef extern from "pageio.h" nogil:
    uint32_t mcf_crc32c(int impl, uint32_t crc, const void *buf, size_t n)
    int mcf_crc32c_variant(int impl)
    ctypedef struct mcf_page_io:
        const char *name
        const char *final
        uint8_t *head
        uint64_t head_len
        uint64_t head_sum_len
        const iovec *iov
        int iovcnt
        uint64_t payload
        int status
        int err
        uint32_t crc
        uint64_t st_dev, st_ino, st_size
        int64_t mtime_ns, ctime_ns
        int fd
    ctypedef struct mcf_page_batch:
        int dir_fd
        unsigned threads
        int impl
        int checksum
        int64_t expire_ns
        int64_t set_mtime_ns
        int durable
        uint64_t payload_crc_at
        uint64_t head_crc_at
    void mcf_pages_read(mcf_page_io *pages, size_t n, const mcf_page_batch *cfg)
    void mcf_pages_write(mcf_page_io *pages, size_t n, const mcf_page_batch *cfg)
    size_t mcf_pages_live(int dir_fd, const char *const *names, size_t n, uint64_t min_size, int64_t expire_ns,
                          int stop_at_gap, uint8_t *live)
    int MCF_PAGE_OK, MCF_PAGE_ABSENT, MCF_PAGE_EXPIRED, MCF_PAGE_OTHER_SIZE, MCF_PAGE_SHORT, MCF_PAGE_ERROR

OK = MCF_PAGE_OK
ABSENT = MCF_PAGE_ABSENT
EXPIRED = MCF_PAGE_EXPIRED
OTHER_SIZE = MCF_PAGE_OTHER_SIZE
SHORT = MCF_PAGE_SHORT
ERROR = MCF_PAGE_ERROR
#: a time before every file's: no page expires
NEVER = -(1 << 63)


def crc32c(data, uint32_t value=0, impl=None):
    """CRC-32C (Castagnoli) of the buffer ``data``, continuing from ``value``; ``impl`` forces a variant
    (``"scalar"``, ``"avx2"`` / ``"avx512"``: SSE4.2's instruction, ``"neon"``: the ARMv8 CRC one), else
    ``$MCF_FORCE_IMPL`` or the best the CPU has."""
    cdef int im = resolve_impl(impl)
    cdef Py_buffer view
    cdef uint32_t out
    if PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0:
        raise ArgumentTypeError(f"crc32c takes a contiguous buffer, not {type(data).__name__}")
    try:
        with nogil:
            out = mcf_crc32c(im, value, view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return out


def crc32c_variant(impl=None):
    """The name of the variant :func:`crc32c` runs for ``impl`` on this CPU (``"scalar"`` where the
    instruction is missing)."""
    return mcf_impl_name(mcf_crc32c_variant(resolve_impl(impl))).decode()


cdef class _Held:
    """The buffers a batch holds, released together."""
    cdef Py_buffer *views
    cdef Py_ssize_t count
    cdef iovec *iov
    cdef mcf_page_io *pages

    def __cinit__(self, Py_ssize_t n_pages, Py_ssize_t n_views):
        self.views = <Py_buffer *>PyMem_Malloc(max(n_views, 1) * sizeof(Py_buffer))
        self.iov = <iovec *>PyMem_Malloc(max(n_views, 1) * sizeof(iovec))
        self.pages = <mcf_page_io *>PyMem_Malloc(max(n_pages, 1) * sizeof(mcf_page_io))
        if self.views == NULL or self.iov == NULL or self.pages == NULL:
            raise MemoryError()
        memset(self.pages, 0, max(n_pages, 1) * sizeof(mcf_page_io))
        self.count = 0

    cdef int hold(self, object buf, int flags) except -1:
        if PyObject_GetBuffer(buf, &self.views[self.count], flags) < 0:
            raise ArgumentTypeError(f"a page is a contiguous{' writable' if flags & PyBUF_WRITABLE else ''} "
                                    f"buffer, not {type(buf).__name__}")
        self.iov[self.count].iov_base = self.views[self.count].buf
        self.iov[self.count].iov_len = <size_t>self.views[self.count].len
        self.count += 1
        return 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.count):
            PyBuffer_Release(&self.views[i])
        PyMem_Free(self.views)
        PyMem_Free(self.iov)
        PyMem_Free(self.pages)


cdef _Held _gather(list names, list finals, list heads, list payloads, bint writable):
    cdef Py_ssize_t n = len(names), i, k, first, total = 0
    if len(heads) != n or len(payloads) != n or (finals is not None and len(finals) != n):
        raise InvalidArgumentError(f"{n} page names but {len(heads)} heads and {len(payloads)} payloads")
    for p in payloads:
        total += len(p)
    cdef _Held h = _Held(n, total + n)
    cdef mcf_page_io *pg
    cdef int flags = PyBUF_WRITABLE if writable else PyBUF_SIMPLE
    for i in range(n):
        if not isinstance(names[i], bytes) or (finals is not None and not isinstance(finals[i], bytes)):
            raise ArgumentTypeError("page names are bytes")
        pg = &h.pages[i]
        pg.name = PyBytes_AS_STRING(names[i])
        pg.final = PyBytes_AS_STRING(finals[i]) if finals is not None else NULL
        h.hold(heads[i], PyBUF_WRITABLE)
        pg.head = <uint8_t *>h.iov[h.count - 1].iov_base
        pg.head_len = h.iov[h.count - 1].iov_len
        first = h.count
        for buf in payloads[i]:
            h.hold(buf, flags)
        pg.iov = &h.iov[first]
        pg.iovcnt = <int>(h.count - first)
        pg.payload = 0
        for k in range(first, h.count):
            pg.payload += h.iov[k].iov_len
        pg.fd = -1
    return h


cdef unsigned _threads(object threads) except 0:
    """``threads=`` by the kernels' one rule (mcf._core._kernel_args: an integer, below 1 one), at most 64
    (the C side starts no more)."""
    cdef Py_ssize_t t = thread_count(threads)
    return <unsigned>(t if t < 64 else 64)


def read_pages(int dir_fd, list names, list heads, list payloads, *, threads=1, impl=None,
               bint checksum=True, int64_t expire_ns=NEVER):
    """Read page ``names[i]`` (relative to ``dir_fd``) into ``heads[i]`` (a bytearray of the bytes before
    the payload) and the writable buffers ``payloads[i]``: per page ``(status, errno, crc32c, (dev, ino,
    size, mtime_ns, ctime_ns))``; status is one of OK, ABSENT, EXPIRED, OTHER_SIZE, SHORT, ERROR."""
    cdef mcf_page_batch cfg
    cdef _Held h = _gather(names, None, heads, payloads, True)
    cdef Py_ssize_t n = len(names), i
    memset(&cfg, 0, sizeof(cfg))
    cfg.dir_fd, cfg.threads, cfg.impl = dir_fd, _threads(threads), resolve_impl(impl)
    cfg.checksum, cfg.expire_ns = checksum, expire_ns
    with nogil:
        mcf_pages_read(h.pages, <size_t>n, &cfg)
    out = []
    for i in range(n):
        p = &h.pages[i]
        out.append((p.status, p.err, p.crc, (p.st_dev, p.st_ino, p.st_size, p.mtime_ns, p.ctime_ns)))
    return out


def write_pages(int dir_fd, list tmp_names, list names, list heads, list head_sum_lens, list payloads, *,
                uint64_t payload_crc_at, uint64_t head_crc_at, threads=1, impl=None,
                int64_t set_mtime_ns=-1, bint durable=False):
    """Write each page: ``payloads[i]`` after ``heads[i]`` (whose two CRC-32C fields, at ``payload_crc_at``
    and ``head_crc_at``, are filled in; the head's covers its first ``head_sum_lens[i]`` bytes) to the temp
    file ``tmp_names[i]``, renamed to ``names[i]``: per page ``(status, errno)``."""
    cdef mcf_page_batch cfg
    cdef _Held h = _gather(tmp_names, names, heads, payloads, False)
    cdef Py_ssize_t n = len(names), i
    if len(head_sum_lens) != n:
        raise InvalidArgumentError(f"{n} pages but {len(head_sum_lens)} head lengths")
    for i in range(n):
        if not 0 <= head_sum_lens[i] <= <Py_ssize_t>h.pages[i].head_len or \
                max(payload_crc_at, head_crc_at) + 4 > h.pages[i].head_len:
            raise InvalidArgumentError(f"page {i}: checksum fields outside its head of {h.pages[i].head_len} bytes")
        h.pages[i].head_sum_len = head_sum_lens[i]
    memset(&cfg, 0, sizeof(cfg))
    cfg.dir_fd, cfg.threads, cfg.impl = dir_fd, _threads(threads), resolve_impl(impl)
    cfg.set_mtime_ns, cfg.durable = set_mtime_ns, durable
    cfg.payload_crc_at, cfg.head_crc_at = payload_crc_at, head_crc_at
    with nogil:
        mcf_pages_write(h.pages, <size_t>n, &cfg)
    return [(h.pages[i].status, h.pages[i].err) for i in range(n)]


def live_pages(int dir_fd, list names, *, uint64_t min_size=0, int64_t expire_ns=NEVER, bint stop_at_gap=True):
    """How many of ``names`` (bytes), from the first, are live pages (regular files of ``min_size`` bytes
    or more, modified after ``expire_ns``), stopping at the first that is not; with ``stop_at_gap=False``
    a bytes object of one 0/1 per name."""
    cdef Py_ssize_t n = len(names), i
    cdef const char **ptrs = <const char **>PyMem_Malloc(max(n, 1) * sizeof(char *))
    cdef bytearray live = bytearray(n)
    cdef uint8_t *lp = NULL
    cdef size_t count
    if ptrs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            if not isinstance(names[i], bytes):
                raise ArgumentTypeError("page names are bytes")
            ptrs[i] = PyBytes_AS_STRING(names[i])
        if not stop_at_gap and n:
            lp = <uint8_t *>(<char *>live)
        with nogil:
            count = mcf_pages_live(dir_fd, ptrs, <size_t>n, min_size, expire_ns, stop_at_gap, lp)
    finally:
        PyMem_Free(ptrs)
    return count if stop_at_gap else bytes(live)
