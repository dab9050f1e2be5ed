# What every compiled kernel wrapper turns into C arguments, written once: the output dtype as an MCF_OUT_*
# kind, ``threads=`` as a thread count, and the row split that runs a GIL-free kernel over a range of rows
# (or blocks) on that many threads.  Inline, as _buffers.pxd: each .pyx that cimports it compiles its own
# copy of these few lines (no extra module).  Not part of mcf.get_include(): it needs csrc/fpconv.h.
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdlib cimport free, malloc

cdef extern from "fpconv.h" nogil:
    # The float formats a kernel writes (the out_kind argument of the dequantizing kernels).
    enum: MCF_OUT_F32, MCF_OUT_F16, MCF_OUT_BF16


cdef inline int out_kind(object dtype) except -1:
    """The MCF_OUT_* kind of a numpy output dtype: float32, float16, bfloat16 (ml_dtypes, or its bits as
    uint16); anything else, or a non-native byte order, is mcf.InvalidArgumentError.  The one place that
    maps output dtypes (mcf._core._kernels.out_kind shows it to Python)."""
    import numpy as np

    dt = np.dtype(dtype)
    if dt.byteorder != ">":
        if dt == np.float32:
            return MCF_OUT_F32
        if dt == np.float16:
            return MCF_OUT_F16
        if dt.name == "bfloat16" or dt == np.uint16:
            return MCF_OUT_BF16
    from mcf._core.args import byte_order_problem
    from mcf.errors import InvalidArgumentError

    raise InvalidArgumentError(byte_order_problem(dt, "the output dtype")
                               or f"output dtype must be float32, float16 or bfloat16, got {dt}")


cdef inline Py_ssize_t thread_count(object threads) except -1:
    """``threads=`` of a kernel call as a thread count: a Python or numpy integer (a bool, a float, None or
    anything else is mcf.InvalidArgumentError, never truncated); a value below 1 means one.  run_split
    starts no more threads than there are rows to split."""
    if type(threads) is not int:
        from mcf._core.args import integer

        threads = integer(threads, "threads")
    if threads <= 1:
        return 1
    return threads if threads < PY_SSIZE_T_MAX else PY_SSIZE_T_MAX


# A GIL-free kernel over pieces [r0, r1) of the work described by ``ctx`` (a struct of the caller's).
ctypedef void (*range_fn)(const void* ctx, size_t r0, size_t r1) noexcept nogil

# What a dequantizing range_fn reads: the tensor (the module's own C struct), where row r0's output starts,
# the bytes of an output row, the MCF_OUT_* kind and the kernel variant.
cdef struct rows_job:
    const void* tensor
    char* out
    size_t r0, row_bytes
    int kind, impl

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_t:
        pass
    int pthread_create(pthread_t* thread, const void* attr, void* (*start)(void*) noexcept nogil, void* arg)
    int pthread_join(pthread_t thread, void** retval)


cdef struct _Part:
    range_fn fn
    const void* ctx
    size_t r0, r1


cdef inline void* _run_part(void* p) noexcept nogil:
    cdef _Part* part = <_Part*>p
    part.fn(part.ctx, part.r0, part.r1)
    return NULL


cdef inline void run_split(range_fn fn, const void* ctx, size_t r0, size_t r1, Py_ssize_t nthreads) noexcept:
    """``fn(ctx, a, b)`` over [r0, r1) cut into ``nthreads`` consecutive parts (part k starts at
    r0 + floor((r1 - r0) * k / nthreads)): the first on this thread, each other one on a thread of its own, the
    GIL released throughout.  Returns when every part is done (they write into the caller's buffers and read
    ``ctx``, which stay valid through the call); a thread that cannot be started has its part run here."""
    cdef size_t n = r1 - r0, want, q, r, k, started = 0
    cdef _Part* parts = NULL
    cdef pthread_t* tids = NULL
    if nthreads > 1 and n > 1:
        want = <size_t>nthreads if <size_t>nthreads < n else n
        parts = <_Part*>malloc(want * sizeof(_Part))
        tids = <pthread_t*>malloc((want - 1) * sizeof(pthread_t))
    if parts == NULL or tids == NULL:      # one thread asked for, or no memory for more: all of it here
        free(parts)
        free(tids)
        with nogil:
            fn(ctx, r0, r1)
        return
    q, r = n // want, n % want             # floor(n * k / want) = q * k + floor(r * k / want), no overflow
    with nogil:
        for k in range(want):
            parts[k].fn = fn
            parts[k].ctx = ctx
            parts[k].r0 = r0 + q * k + r * k // want
            parts[k].r1 = r0 + q * (k + 1) + r * (k + 1) // want
        for k in range(1, want):
            if pthread_create(&tids[started], NULL, _run_part, &parts[k]) == 0:
                started += 1
            else:
                _run_part(&parts[k])
        _run_part(&parts[0])
        for k in range(started):
            pthread_join(tids[k], NULL)
    free(parts)
    free(tids)
