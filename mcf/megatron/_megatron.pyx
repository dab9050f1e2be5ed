# cython: freethreading_compatible = False
"""Compiled kernels of the Megatron indexed dataset: per-item views, batch gather, index checks, prefix
sums, token range checks and Megatron's ``build_sample_idx``.

The ``.idx`` arrays start at odd offsets (34 + ...), so every load from them goes through ``memcpy``
(one unaligned ``mov`` on x86).  Callers (mcf/megatron/*.py) validate counts and sizes with Python
integers first; each kernel re-checks the buffer lengths it is given before entering a ``nogil`` loop.
"""

import numpy as np

cimport numpy as cnp
from cpython.long cimport PyLong_AsSsize_t
from cpython.number cimport PyNumber_Index
from cpython.object cimport PyObject_TypeCheck, PyTypeObject
from cpython.ref cimport Py_INCREF
from libc.math cimport ceilf
from libc.stdlib cimport calloc, free
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from mcf._core._io cimport Source

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # steals a reference to `descr`
    object PyArray_NewFromDescr(type subtype, cnp.dtype descr, int nd, cnp.npy_intp* dims,
                                cnp.npy_intp* strides, void* data, int flags, object obj)

cdef extern from "numpy/ndarrayobject.h":
    PyTypeObject PyIntegerArrType_Type     # np.integer: every numpy integer scalar type derives from it

cdef extern from *:
    """
    static inline int mg_add_i64(long long a, long long b, long long *r) { return __builtin_add_overflow(a, b, r); }
    static inline int mg_mul_i64(long long a, long long b, long long *r) { return __builtin_mul_overflow(a, b, r); }
    static inline void mg_prefetch(const void *p) { __builtin_prefetch(p, 0, 0); }
    """
    int mg_add_i64(long long a, long long b, long long* r) nogil
    int mg_mul_i64(long long a, long long b, long long* r) nogil
    void mg_prefetch(const void* p) nogil

from mcf._core.args import index_array, integer
from mcf.errors import ClosedError, InvalidArgumentError, OutOfBoundsError

INT32_MAX = 2**31 - 1
DEF PREFETCH_AHEAD = 8


cdef inline int32_t ld32(const uint8_t* p) noexcept nogil:
    cdef int32_t v
    memcpy(&v, p, 4)
    return v


cdef inline int64_t ld64(const uint8_t* p) noexcept nogil:
    cdef int64_t v
    memcpy(&v, p, 8)
    return v


cdef inline void note(int64_t* bad, Py_ssize_t kmax, int64_t count, int64_t i) noexcept nogil:
    if count < kmax:
        bad[count] = i


cdef int64_t* _bad_ptr(int64_t[::1] bad):
    return &bad[0] if bad.shape[0] else NULL


# -- index checks: each returns the number of offending positions and records the first len(bad) ------
def check_lengths(const uint8_t[::1] lens, Py_ssize_t n, int64_t[::1] bad):
    """Count negative sequence lengths."""
    if n < 0 or lens.shape[0] < 4 * n:
        raise InvalidArgumentError("check_lengths: buffer too small")
    cdef const uint8_t* p = &lens[0] if n else NULL
    cdef int64_t* b = _bad_ptr(bad)
    cdef Py_ssize_t k = bad.shape[0], i
    cdef int64_t count = 0
    with nogil:
        for i in range(n):
            if ld32(p + 4 * i) < 0:
                note(b, k, count, i)
                count += 1
    return count


def check_pointers(const uint8_t[::1] lens, const uint8_t[::1] ptrs, Py_ssize_t n, int64_t itemsize,
                   int64_t[::1] bad):
    """Count sequences whose pointer is not the end of the previous one (0 for the first): the
    pointers must be the exclusive prefix sums of length * itemsize."""
    if n < 0 or lens.shape[0] < 4 * n or ptrs.shape[0] < 8 * n:
        raise InvalidArgumentError("check_pointers: buffer too small")
    cdef const uint8_t* pl = &lens[0] if n else NULL
    cdef const uint8_t* pp = &ptrs[0] if n else NULL
    cdef int64_t* b = _bad_ptr(bad)
    cdef Py_ssize_t k = bad.shape[0], i
    cdef int64_t count = 0
    cdef uint64_t want = 0
    with nogil:
        for i in range(n):
            if <uint64_t>ld64(pp + 8 * i) != want:
                note(b, k, count, i)
                count += 1
            # wrapping arithmetic: any mismatch shows; extents are checked separately
            want = <uint64_t>ld64(pp + 8 * i) + <uint64_t><int64_t>ld32(pl + 4 * i) * <uint64_t>itemsize
    return count


def check_extents(const uint8_t[::1] lens, const uint8_t[::1] ptrs, Py_ssize_t n, int64_t itemsize,
                  uint64_t bin_size, int64_t[::1] bad):
    """Count sequences whose bytes ``[pointer, pointer + length*itemsize)`` do not lie inside the .bin
    (negative pointers included; negative lengths are ``check_lengths``' to report)."""
    if n < 0 or lens.shape[0] < 4 * n or ptrs.shape[0] < 8 * n or itemsize < 1 or itemsize > 8:
        raise InvalidArgumentError("check_extents: bad arguments")
    cdef const uint8_t* pl = &lens[0] if n else NULL
    cdef const uint8_t* pp = &ptrs[0] if n else NULL
    cdef int64_t* b = _bad_ptr(bad)
    cdef Py_ssize_t k = bad.shape[0], i
    cdef int64_t count = 0, ln, pt
    cdef uint64_t nb
    with nogil:
        for i in range(n):
            ln = ld32(pl + 4 * i)
            pt = ld64(pp + 8 * i)
            nb = <uint64_t>ln * <uint64_t>itemsize
            if ln >= 0 and (pt < 0 or <uint64_t>pt > bin_size or nb > bin_size - <uint64_t>pt):
                note(b, k, count, i)
                count += 1
    return count


def check_documents(const uint8_t[::1] docs, Py_ssize_t d, int64_t n, int64_t[::1] bad):
    """Count positions of the document index that break ``0 = di[0] <= di[1] <= ... <= di[-1] = N``
    (a value outside [0, N] counts too)."""
    if d < 0 or docs.shape[0] < 8 * d:
        raise InvalidArgumentError("check_documents: buffer too small")
    cdef const uint8_t* p = &docs[0] if d else NULL
    cdef int64_t* b = _bad_ptr(bad)
    cdef Py_ssize_t k = bad.shape[0], i
    cdef int64_t count = 0, v, prev = 0
    with nogil:
        for i in range(d):
            v = ld64(p + 8 * i)
            if (i == 0 and v != 0) or (i == d - 1 and v != n) or v < prev or v < 0 or v > n:
                note(b, k, count, i)
                count += 1
            if v > prev:
                prev = v
    return count


# -- writer kernels ------------------------------------------------------------------------------------
def prefix_pointers(const int32_t[::1] lengths, int64_t itemsize, int64_t start, int64_t[::1] out):
    """Exclusive prefix sums of ``lengths * itemsize`` starting at ``start`` into ``out``; returns the
    end offset.  Raises ``InvalidArgumentError`` on a negative length or int64 overflow."""
    cdef Py_ssize_t n = lengths.shape[0], i
    if out.shape[0] < n:
        raise InvalidArgumentError("prefix_pointers: output too small")
    cdef long long cur = start, nb
    cdef Py_ssize_t fail = -1
    with nogil:
        for i in range(n):
            out[i] = cur
            if lengths[i] < 0 or mg_mul_i64(lengths[i], itemsize, &nb) or mg_add_i64(cur, nb, &cur):
                fail = i
                break
    if fail >= 0:
        raise InvalidArgumentError(
            f"sequence {fail}: length {lengths[fail]} is negative or the byte offsets overflow int64")
    return cur


ctypedef fused int_in:
    int8_t
    int16_t
    int32_t
    int64_t
    uint8_t
    uint16_t
    uint32_t
    uint64_t


def find_out_of_range(const int_in[::1] a, int64_t lo, int64_t hi):
    """Index of the first value outside ``[lo, hi]`` (``hi >= 0``), or -1."""
    cdef Py_ssize_t n = a.shape[0], i, found = -1
    if hi < 0:
        raise InvalidArgumentError("hi must be >= 0")
    with nogil:
        if int_in is uint8_t or int_in is uint16_t or int_in is uint32_t or int_in is uint64_t:
            for i in range(n):
                if <uint64_t>a[i] > <uint64_t>hi:
                    found = i
                    break
        else:
            for i in range(n):
                if <int64_t>a[i] < lo or <int64_t>a[i] > hi:
                    found = i
                    break
    return found


def flat_tokens(list ids_lists, cnp.dtype dtype):
    """Concatenate lists of Python ints (tokenizer output) into one array of ``dtype`` plus their
    lengths (int32), checking every id against the dtype's range on the way."""
    cdef Py_ssize_t n = len(ids_lists), i, j, total = 0, m
    cdef cnp.ndarray lengths = np.empty(n, dtype=np.int32)
    cdef int32_t* lp = <int32_t*>cnp.PyArray_DATA(lengths)
    cdef list ids
    for i in range(n):
        m = len(<list>ids_lists[i])
        if m > INT32_MAX:
            raise InvalidArgumentError(f"document {i} has {m} tokens, more than a sequence can hold")
        lp[i] = <int32_t>m
        total += m
    cdef cnp.ndarray out = np.empty(total, dtype=dtype)
    cdef int64_t lo, hi, v
    cdef Py_ssize_t pos = 0
    cdef int isz = dtype.itemsize
    cdef uint8_t* o = <uint8_t*>cnp.PyArray_DATA(out)
    if dtype.kind not in "iu":
        raise InvalidArgumentError(f"token dtype must be an integer dtype, not {dtype}")
    info = np.iinfo(dtype)
    lo = info.min
    hi = info.max if info.max < 2**63 else 2**63 - 1
    for i in range(n):
        ids = <list>ids_lists[i]
        for j in range(len(ids)):
            try:
                v = ids[j]
            except (OverflowError, TypeError):
                raise InvalidArgumentError(f"token id {ids[j]!r} (document {i}, position {j}) is not an "
                                           f"integer that fits {dtype}") from None
            if v < lo or v > hi:
                raise InvalidArgumentError(
                    f"token id {v} (document {i}, position {j}) does not fit {dtype} [{lo}, {hi}]")
            if isz == 2:
                (<uint16_t*>o)[pos] = <uint16_t>v
            elif isz == 4:
                (<int32_t*>o)[pos] = <int32_t>v
            elif isz == 1:
                o[pos] = <uint8_t>v
            else:
                (<int64_t*>o)[pos] = v
            pos += 1
    return out, lengths


# -- Megatron's build_sample_idx -------------------------------------------------------------------
ctypedef fused sample_t:
    int32_t
    int64_t


cdef int64_t _sample_loop(const int32_t* sizes, Py_ssize_t n_sizes, const int32_t* document_idx,
                          Py_ssize_t n_doc_idx, int32_t seq_length, int64_t num_samples, int add_extra,
                          sample_t* sample_idx, int64_t* stuck_at) noexcept nogil:
    # The loop of Megatron-LM's helpers.cpp build_sample_idx<T>, statement for statement, with the
    # same variable types (so the same integer conversions).  Every document id is checked when it is
    # read (returns its position in document_idx, else -1); ``stuck_at`` receives the first sample
    # (row) whose end lies past the last document, or stays -1.
    cdef int64_t sample_idx_index = 0
    cdef sample_t document_idx_index = 0
    cdef sample_t doc_offset = 0
    cdef int32_t remaining_seq_length
    cdef int32_t document_index
    cdef sample_t document_length
    stuck_at[0] = -1
    sample_idx[0] = document_idx_index
    sample_idx[1] = doc_offset
    sample_idx_index += 1
    while sample_idx_index <= num_samples:
        remaining_seq_length = seq_length + add_extra
        while remaining_seq_length != 0:
            document_index = document_idx[document_idx_index]
            if document_index < 0 or document_index >= n_sizes or sizes[document_index] < 0:
                return document_idx_index
            document_length = sizes[document_index] - doc_offset
            remaining_seq_length = <int32_t>(remaining_seq_length - document_length)
            if remaining_seq_length <= 0:
                doc_offset += (remaining_seq_length + document_length - add_extra)
                remaining_seq_length = 0
            else:
                if document_idx_index == n_doc_idx - 1:
                    if stuck_at[0] < 0:
                        stuck_at[0] = sample_idx_index
                    doc_offset = sizes[document_idx[document_idx_index]] - add_extra
                    break
                document_idx_index += 1
                doc_offset = 0
        sample_idx[2 * sample_idx_index] = document_idx_index
        sample_idx[2 * sample_idx_index + 1] = doc_offset
        sample_idx_index += 1
    return -1


def num_samples_for(int64_t num_epochs, int64_t tokens_per_epoch, int64_t seq_length,
                    bint drop_last_partial_sequence, int64_t add_extra):
    """Megatron's sample count: floor division when dropping the last partial sequence, else the
    ceiling computed in single precision (``ceil(float(x) / seq_length)``, float rounding included)."""
    cdef long long x
    if mg_mul_i64(num_epochs, tokens_per_epoch, &x):
        raise InvalidArgumentError("num_epochs * tokens_per_epoch overflows int64")
    x -= add_extra
    if drop_last_partial_sequence:
        return x // seq_length if x >= 0 else -((-x) // seq_length)  # C truncation toward zero
    return <int64_t>ceilf(<float>x / <float><int32_t>seq_length)


def build_sample_idx_raw(const int32_t[::1] sizes, const int32_t[::1] document_idx, int32_t seq_length,
                         int64_t num_samples, int add_extra, bint use_int64):
    """``(sample_idx, bad_position, stuck_at)``: the sample index, ``[num_samples + 1, 2]``; the position
    in ``document_idx`` of the first invalid document id met (-1 if none: then the index is complete);
    the first sample whose end lies past the documents (-1 if none)."""
    cdef Py_ssize_t n = document_idx.shape[0], ns = sizes.shape[0]
    if n == 0 or ns == 0 or num_samples < 0 or seq_length < 1 or add_extra < 0 or add_extra > 1:
        raise InvalidArgumentError("build_sample_idx_raw: empty input or bad arguments")
    cdef cnp.ndarray out = np.empty((num_samples + 1, 2), dtype=np.int64 if use_int64 else np.int32)
    cdef const int32_t* ps = &sizes[0]
    cdef const int32_t* pd = &document_idx[0]
    cdef void* po = cnp.PyArray_DATA(out)
    cdef int64_t bad, stuck = -1
    with nogil:
        if use_int64:
            bad = _sample_loop[int64_t](ps, ns, pd, n, seq_length, num_samples, add_extra, <int64_t*>po, &stuck)
        else:
            bad = _sample_loop[int32_t](ps, ns, pd, n, seq_length, num_samples, add_extra, <int32_t*>po, &stuck)
    return out, bad, stuck


# -- the reader's hot paths ----------------------------------------------------------------------------


cdef object _read_bin(Source bin_src, const uint8_t* base, object whole, uint64_t size, cnp.dtype dtype,
                      int64_t ptr, int64_t count):
    """``count`` items of ``dtype`` at byte ``ptr`` of a .bin: a read-only view of the mapping ``base``
    (kept alive by ``whole``) when mapped, else a new array filled by ``bin_src.copy_to``."""
    cdef cnp.npy_intp dims[1]
    cdef uint64_t nb = <uint64_t>count * <uint64_t>dtype.itemsize
    if count < 0 or ptr < 0 or <uint64_t>ptr > size or nb > size - <uint64_t>ptr:
        raise OutOfBoundsError(f"read of {count} items at byte {ptr} lies outside the .bin ({size} bytes)")
    dims[0] = <cnp.npy_intp>count
    if base != NULL:
        Py_INCREF(dtype)  # stolen by PyArray_NewFromDescr
        arr = PyArray_NewFromDescr(<type>np.ndarray, dtype, 1, dims, NULL, <void*>(base + ptr),
                                   cnp.NPY_ARRAY_C_CONTIGUOUS, None)
        Py_INCREF(whole)  # stolen by PyArray_SetBaseObject
        cnp.PyArray_SetBaseObject(<cnp.ndarray>arr, whole)
        cnp.PyArray_UpdateFlags(<cnp.ndarray>arr, cnp.NPY_ARRAY_ALIGNED)
        return arr
    out = cnp.PyArray_EMPTY(1, dims, dtype.type_num, 0)
    if nb:
        if bin_src is None:
            raise ClosedError("the dataset is closed")
        bin_src.copy_to(<uint64_t>ptr, <size_t>nb, cnp.PyArray_DATA(<cnp.ndarray>out))
    return out


cdef cnp.ndarray _gather_output(object out, cnp.dtype dtype, int64_t total):
    """The array a gather fills: a new one, or the first ``total`` items of the caller's ``out``."""
    if out is None:
        return np.empty(total, dtype=dtype)
    if (not isinstance(out, np.ndarray) or out.dtype != dtype or out.ndim != 1
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise InvalidArgumentError(f"out must be a writable contiguous 1-D {dtype} array")
    if out.shape[0] < total:
        raise InvalidArgumentError(f"out holds {out.shape[0]} items, {total} needed")
    return out[:total]


cdef inline bint _is_np_integer(object x):
    """``isinstance(x, np.integer)`` without a Python call (numpy's bool is not an np.integer)."""
    return PyObject_TypeCheck(x, &PyIntegerArrType_Type)


cdef inline object _int_of(object x, str what):
    """``x`` as a Python int under mcf._core.args.integer's rules, with Python and numpy integers taken on
    the compiled path: data loaders index with numpy integers (Megatron's sample and shuffle indices are
    numpy arrays), and the Python-level check made ``ds[np.int64(i)]`` 4-5x slower than ``ds[i]``.
    Everything else (bools, floats, strings) goes to ``integer``, which refuses it with the message."""
    if type(x) is int:
        return x
    if _is_np_integer(x):
        return PyNumber_Index(x)
    return integer(x, what)


cdef Py_ssize_t _norm_index(object idx, Py_ssize_t n) except -2:
    """Sequence index ``idx`` (negative counts from the end) checked against ``n`` sequences: Python and
    numpy integers only, never a bool or a float (mcf._core.args.integer)."""
    cdef Py_ssize_t i
    idx = _int_of(idx, "a sequence index")
    try:
        i = PyLong_AsSsize_t(idx)
    except OverflowError:
        raise OutOfBoundsError(f"sequence index {idx} out of range for {n} sequences") from None
    if i < 0:
        i += n
    if i < 0 or i >= n:
        raise OutOfBoundsError(f"sequence index {idx} out of range for {n} sequences")
    return i


cdef int64_t _part_of(object offset, object length, int64_t ln, Py_ssize_t i, int64_t* count) except -1:
    """The offset of ``get(i, offset, length)`` in sequence ``i`` of ``ln`` tokens, checked; its token
    count goes to ``count``."""
    off = _int_of(offset, "offset")
    if off < 0 or off > ln:
        raise OutOfBoundsError(f"offset {off} outside sequence {i} of length {ln}")
    cnt = ln - off if length is None else _int_of(length, "length")
    if cnt < 0 or cnt > ln - off:
        raise OutOfBoundsError(f"length {cnt} at offset {off} runs past the end of sequence {i} (length {ln})")
    count[0] = cnt
    return off


# -- one dataset, or many read as one -------------------------------------------------------------------
cdef struct _Shard:
    const uint8_t* lens          # int32[n], unaligned
    const uint8_t* ptrs          # int64[n], unaligned
    const uint8_t* base          # mapping of the shard's .bin, or NULL (pread, file-like, empty)
    uint64_t size                # .bin size
    int64_t n
    int ready                    # bound by _bind_shard


cdef class _Table:
    """Per-sequence access over datasets read as one, with global sequence ids: the compiled part of
    ``IndexedDataset`` (one dataset is a one-shard table, :class:`SequenceTable`) and of ``ShardedDataset``
    (:class:`ShardTable`).  Integer indexing, ``get`` and ``gather`` run here; every other key goes to
    ``self._getitem_other``.

    Shard ``k`` holds the global sequences ``[starts[k], starts[k+1])``.  A shard's arrays are bound once the
    Python side has validated its index against its .bin (``_bind_shard``); a table of many binds each on
    first touch (``self._open_shard(k)``).  A lookup starts at the shard of its bucket (buckets about half
    a shard wide) and moves on a step or two; a long run of tiny shards falls back to a binary search.
    """

    cdef int64_t* _starts        # K + 1 global sequence ids
    cdef int32_t* _buckets       # shard holding sequence b << _shift, for every b (a lookup's first guess)
    cdef int _shift
    cdef _Shard* _shards         # K slots; freed only in __dealloc__ (a gather may still read them)
    cdef Py_ssize_t _k
    cdef int64_t _n
    cdef list _srcs              # per shard: the .bin Source once bound
    cdef list _keep              # per shard: what owns its mapping and index arrays once bound; the list
                                 # itself is the owner (numpy base) of the views of a table of many shards
    cdef cnp.dtype _dtype
    cdef bint _bound

    def __dealloc__(self):
        free(self._starts)
        free(self._buckets)
        free(self._shards)

    cdef int _setup(self, starts, cnp.dtype dtype) except -1:
        a = np.ascontiguousarray(starts, dtype=np.int64)
        if a.ndim != 1 or a.shape[0] < 1 or int(a[0]) != 0 or (a.shape[0] > 1 and bool((np.diff(a) < 0).any())):
            raise InvalidArgumentError("_init_table: starts must run from 0 without decreasing")
        if self._starts != NULL:
            raise InvalidArgumentError("_init_table: already initialized")
        cdef const int64_t[::1] av = a
        cdef Py_ssize_t k = a.shape[0] - 1, i
        if k >= INT32_MAX:
            raise InvalidArgumentError("_init_table: too many shards")
        # Buckets about half a shard wide: a lookup starts at its bucket's shard and moves on a step or
        # two, instead of a binary search over all the starts (each step of which waits for a load).
        cdef int64_t n = av[k]
        cdef int shift = 0
        while k and (n >> shift) > 2 * k:
            shift += 1
        cdef Py_ssize_t nb = (n >> shift) + 1
        cdef const int64_t[::1] bk = np.searchsorted(a[:k], np.arange(nb, dtype=np.int64) << shift,
                                                     side="right").astype(np.int64) - 1 if k else np.zeros(1, np.int64)
        self._starts = <int64_t*>calloc(k + 1, sizeof(int64_t))
        self._buckets = <int32_t*>calloc(nb, sizeof(int32_t))
        self._shards = <_Shard*>calloc(k if k else 1, sizeof(_Shard))
        if self._starts == NULL or self._buckets == NULL or self._shards == NULL:
            raise MemoryError()
        for i in range(k + 1):
            self._starts[i] = av[i]
        for i in range(nb):
            self._buckets[i] = <int32_t>(bk[i] if bk[i] > 0 else 0)
        self._shift = shift
        self._k = k
        self._n = av[k]
        self._srcs = [None] * k
        self._keep = [None] * k
        self._dtype = dtype
        self._bound = True
        return 0

    def _bind_shard(self, Py_ssize_t k, const uint8_t[::1] lens, const uint8_t[::1] ptrs, Py_ssize_t n,
                    object idx_keep, Source bin_src, cnp.dtype dtype):
        if not 0 <= k < self._k:
            raise InvalidArgumentError("_bind_shard: no such shard")
        if n != self._starts[k + 1] - self._starts[k] or lens.shape[0] < 4 * n or ptrs.shape[0] < 8 * n:
            raise InvalidArgumentError("_bind_shard: index arrays do not match the shard's sequence count")
        if dtype != self._dtype:
            raise InvalidArgumentError("_bind_shard: dtype differs")
        if not self._bound or self._shards[k].ready:
            return
        self._srcs[k] = bin_src
        self._keep[k] = (bin_src._whole if bin_src.base != NULL else None, idx_keep, lens, ptrs)
        cdef _Shard* sh = &self._shards[k]
        sh.lens = &lens[0] if n else NULL
        sh.ptrs = &ptrs[0] if n else NULL
        sh.base = bin_src.base
        sh.size = bin_src._size
        sh.n = n
        sh.ready = 1

    def _unbind(self):
        """Drop every shard; arrays handed out earlier (and gathers in flight) keep what they reference
        alive.  The slots stay allocated, unread, until the table is freed."""
        self._bound = False
        self._srcs = None
        self._keep = None

    cdef inline int _check_open(self) except -1:
        if not self._bound:
            raise ClosedError("the dataset is closed")
        return 0

    cdef inline Py_ssize_t _norm(self, object idx) except -2:
        return _norm_index(idx, self._n)

    cdef inline Py_ssize_t _locate(self, int64_t i) noexcept nogil:
        """The shard holding global sequence ``0 <= i < n``: the last k with starts[k] <= i."""
        if self._k == 1:                         # one dataset
            return 0
        cdef Py_ssize_t k = self._buckets[i >> self._shift], steps = 0, lo, hi, mid
        while self._starts[k + 1] <= i:          # ends: starts[K] = n > i
            k += 1
            steps += 1
            if steps == 4:                       # a run of tiny shards: search the rest of the bucket
                lo, hi = k, self._k
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if self._starts[mid] <= i:
                        lo = mid
                    else:
                        hi = mid
                return lo
        return k

    cdef int _ready(self, Py_ssize_t k) except -1:
        if not self._shards[k].ready:
            self._open_shard(k)
            if not self._shards[k].ready:
                self._check_open()
                # _open_shard binds the shard or raises: reaching this line is a bug in mcf, not a bad file
                raise AssertionError(f"shard {k} was not bound by _open_shard")
        return 0

    cdef object _read(self, Py_ssize_t k, int64_t ptr, int64_t count):
        """``count`` items at byte ``ptr`` of shard ``k``'s .bin: a view when mapped, else a new array."""
        self._check_open()   # again: the caller may have let a closing thread run (a Python call)
        cdef _Shard* sh = &self._shards[k]
        if sh.base == NULL:
            return _read_bin(<Source>self._srcs[k], NULL, None, sh.size, self._dtype, ptr, count)
        # The view's owner, an owned reference taken before the allocation inside may let a closing thread
        # run: for many shards the list that keeps every bound shard's mapping alive (one object, hot in the
        # cache, instead of one per shard: with a thousand shards, touching per-shard objects costs more
        # than the rest of the lookup); for one, the mapping of its .bin alone.
        owner = self._keep if self._k > 1 else (<tuple>self._keep[0])[0]
        return _read_bin(None, sh.base, owner, sh.size, self._dtype, ptr, count)

    def __len__(self):
        return self._n

    def __getitem__(self, idx):
        cdef Py_ssize_t i, k, j
        cdef _Shard* sh
        if type(idx) is int or _is_np_integer(idx):
            self._check_open()
            i = self._norm(idx)
            k = self._locate(i)
            sh = &self._shards[k]
            if not sh.ready:
                self._ready(k)
            j = i - self._starts[k]
            return self._read(k, ld64(sh.ptrs + 8 * j), ld32(sh.lens + 4 * j))
        return self._getitem_other(idx)

    def get(self, idx, offset=0, length=None):
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None).

        Unlike Megatron's ``IndexedDataset.get``, a range outside the sequence raises
        :class:`mcf.OutOfBoundsError` instead of reading into the next sequence or past the file."""
        self._check_open()
        cdef Py_ssize_t i = self._norm(idx)
        cdef Py_ssize_t k = self._locate(i)
        self._ready(k)
        cdef _Shard* sh = &self._shards[k]
        cdef Py_ssize_t j = i - self._starts[k]
        cdef int64_t ln = ld32(sh.lens + 4 * j)
        cdef int64_t cnt
        cdef int64_t off = _part_of(offset, length, ln, i, &cnt)
        return self._read(k, ld64(sh.ptrs + 8 * j) + off * self._dtype.itemsize, cnt)

    def _sequence_length(self, idx):
        self._check_open()
        cdef Py_ssize_t i = self._norm(idx)
        cdef Py_ssize_t k = self._locate(i)
        self._ready(k)
        return ld32(self._shards[k].lens + 4 * (i - self._starts[k]))

    def gather(self, indices, out=None):
        """Read many sequences into one flat array: returns ``(tokens, offsets)`` with sequence ``k`` at
        ``tokens[offsets[k]:offsets[k+1]]``.  Copies from a mapped .bin run with the GIL released; ``out`` may
        be a preallocated 1-D array of the dataset's dtype (a prefix of it is filled and returned)."""
        self._check_open()
        # Another thread may close the dataset whenever the GIL is released (numpy calls below may release
        # it, the copies do): the mappings and Sources stay alive through these references, and the shard
        # slots until the table is freed.
        srcs, keep = self._srcs, self._keep
        idx_arr = index_array(indices, self._n)   # numpy's rules: integers, or a mask of N bools
        cdef const int64_t[::1] ix = idx_arr
        cdef Py_ssize_t m = ix.shape[0], k, s, bad = -1
        cdef cnp.ndarray loc = np.empty(2 * m, dtype=np.int64)   # (shard, byte offset in its .bin) of each
        cdef int64_t* pl = <int64_t*>cnp.PyArray_DATA(loc)
        cdef cnp.ndarray offsets = np.empty(m + 1, dtype=np.int64)
        cdef int64_t* po = <int64_t*>cnp.PyArray_DATA(offsets)
        cdef int64_t j, ln, total = 0, n = self._n
        cdef bint negative = False
        cdef _Shard* sh
        # First pass, under the GIL (a shard touched for the first time is opened here): locate each
        # sequence.  It only reads the starts and buckets, which stay in the cache.
        for k in range(m):
            j = ix[k]
            if j < 0:
                j = j + n
            if j < 0 or j >= n:
                bad = k
                break
            s = self._locate(j)
            if not self._shards[s].ready:
                self._ready(s)
            pl[2 * k] = s
            pl[2 * k + 1] = j - self._starts[s]
        # Second pass: lengths and pointers.  Every address is known up front, so the loads from the
        # shards' indexes (cache misses, for random sequences) overlap instead of waiting on a lookup.
        if bad < 0:
            with nogil:
                po[0] = 0
                for k in range(m):
                    sh = &self._shards[pl[2 * k]]
                    j = pl[2 * k + 1]
                    ln = ld32(sh.lens + 4 * j)
                    if ln < 0:  # only possible with validate=False
                        bad = k
                        negative = True
                        break
                    pl[2 * k + 1] = ld64(sh.ptrs + 8 * j)
                    total += ln
                    po[k + 1] = total
        if bad >= 0:
            if negative:
                raise OutOfBoundsError(f"sequence {ix[bad]} has a negative length in the index")
            raise OutOfBoundsError(f"indices[{bad}] = {ix[bad]} out of range for {n} sequences")
        cdef cnp.ndarray res = _gather_output(out, self._dtype, total)
        cdef uint8_t* dst = <uint8_t*>cnp.PyArray_DATA(res)
        cdef int64_t isz = self._dtype.itemsize, p, nb
        cdef _Shard* shp
        with nogil:
            for k in range(m):
                if k + PREFETCH_AHEAD < m:
                    # random sequences miss the caches: start loading one a few copies ahead
                    shp = &self._shards[pl[2 * (k + PREFETCH_AHEAD)]]
                    p = pl[2 * (k + PREFETCH_AHEAD) + 1]
                    if shp.base != NULL and p >= 0 and <uint64_t>p < shp.size:
                        mg_prefetch(shp.base + p)
                nb = (po[k + 1] - po[k]) * isz
                if nb == 0:
                    continue
                sh = &self._shards[pl[2 * k]]
                p = pl[2 * k + 1]
                if p < 0 or <uint64_t>p > sh.size or <uint64_t>nb > sh.size - <uint64_t>p:
                    bad = k
                    break
                if sh.base != NULL:
                    memcpy(dst + po[k] * isz, sh.base + p, <size_t>nb)
                else:   # a .bin read through pread or a file object (a positional read per sequence)
                    with gil:
                        (<Source>srcs[pl[2 * k]]).copy_to(<uint64_t>p, <size_t>nb, dst + po[k] * isz)
        del srcs, keep
        if bad >= 0:
            where = "" if self._k == 1 else f" of shard {pl[2 * bad]}"
            raise OutOfBoundsError(f"sequence {ix[bad]} lies outside the .bin{where}")
        return res, offsets


cdef class SequenceTable(_Table):
    """One dataset as a table of one shard; the base class of ``IndexedDataset``.  ``_bind`` is called once
    the Python side has validated the index against the .bin."""

    def _bind(self, lens, ptrs, Py_ssize_t n, object idx_keep, Source bin_src, cnp.dtype dtype):
        if n < 0:
            raise InvalidArgumentError("_bind: negative sequence count")
        self._setup((0, n), dtype)
        self._bind_shard(0, lens, ptrs, n, idx_keep, bin_src, dtype)


cdef class ShardTable(_Table):
    """Many datasets as one, with global sequence ids; the base class of ``ShardedDataset``.

    The starts come from the headers (or a shard list), so nothing of a shard is read until it is first
    touched: then the Python side opens and validates it (``_open_shard(k)``) and binds its arrays
    (``_bind_shard``)."""

    def _init_table(self, starts, cnp.dtype dtype):
        self._setup(starts, dtype)

    def _shard_bound(self, Py_ssize_t k):
        return 0 <= k < self._k and self._shards[k].ready != 0

    def _locate_sequence(self, idx):
        """(shard, local sequence id) of global sequence ``idx``."""
        self._check_open()
        cdef Py_ssize_t i = self._norm(idx)
        cdef Py_ssize_t k = self._locate(i)
        return k, i - self._starts[k]
