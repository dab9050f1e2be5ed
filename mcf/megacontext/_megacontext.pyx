# cython: freethreading_compatible = False
"""Compiled working-context assembly, row gathers and mean pooling for MegaContext trees.

The Python layer (mcf/megacontext/assembly.py, gist.py) owns the API; this module checks every count,
index, dtype and buffer size it is handed, then runs the C loops of csrc/megacontext.c with the GIL
released.  Files are read through the I/O core: straight from the mapping when a Source is mapped,
else one positional read per plan entry into scratch memory first.
"""

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memset

from mcf._core._buffers cimport check_out
from mcf._core._fpconv cimport resolve_impl as _resolve_impl
from mcf._core._kernel_args cimport run_split, thread_count
from mcf._core._io cimport Source

from mcf._core.args import byte_order_problem
from mcf.errors import InvalidArgumentError, OutOfBoundsError

cnp.import_array()

cdef extern from "megacontext.h" nogil:
    ctypedef struct mc_assembly:
        const uint32_t *tokens
        const uint8_t *gists[3]
        int gist_dtype[3]
        size_t gist_stride[3]
        int impl
        uint32_t dim
        uint32_t block_size
        const uint8_t *plan_level
        const int64_t *plan_index
        const int64_t *src_first
        const int64_t *rows
        const int64_t *out_row
        const int64_t *out_slot
        uint8_t *levels
        int64_t *positions
        uint32_t *token_ids
        uint8_t *gists_out
        uint8_t *matrix
        int out_dtype
        size_t out_row_bytes
        const uint8_t *table
        uint64_t vocab
        int table_dtype
        size_t table_row_stride
        const uint8_t **row_src
        uint8_t *row_dtype
    int64_t mc_plan_rows(const mc_assembly *a, size_t e0, size_t e1)
    void mc_copy_rows(const mc_assembly *a, size_t r0, size_t r1, int stream)
    int64_t mc_assemble(const mc_assembly *a, size_t n_entries, size_t n_rows, int stream)
    void mc_convert(const void *src, int src_dtype, void *dst, int dst_dtype, size_t n)
    void mc_decode_q8_row(const uint8_t *row, uint32_t dim, void *out, int out_dtype, int impl)
    void mc_pool_rows(const uint8_t *rows, int src_dtype, size_t n_groups, uint32_t group, uint32_t dim,
                      uint8_t *out, int out_dtype, double *acc)
    int64_t mc_pool_tokens(const uint32_t *ids, size_t n_groups, uint32_t group, const uint8_t *table,
                           uint64_t vocab, int table_dtype, size_t table_row_stride, uint32_t dim,
                           uint8_t *out, int out_dtype, double *acc)

cdef extern from "quant.h" nogil:
    int mcf_quantize_rows_search(int family, int bits, const float *src, size_t nrows, size_t cols, float min_clip,
                                 float max_clip, const float *weights, uint16_t *scales, uint8_t *sub, uint8_t *codes,
                                 int impl)

cdef enum:
    HEADER = 64
    Q8 = 4
    Q8_BLOCK = 32

try:
    import ml_dtypes as _ml_dtypes
    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = None

_F16 = np.dtype("<f2")
_F32 = np.dtype("<f4")


def float_code(dt):
    """The .ctx dtype code of a numpy float dtype (1 fp16, 2 bf16, 3 fp32), or -1."""
    dt = np.dtype(dt)
    if dt == _F16:
        return 1
    if dt == _F32:
        return 3
    if _BF16 is not None and dt == _BF16:
        return 2
    return -1


def numpy_dtype(int code):
    """The numpy dtype rows of ``code`` are handed out as (bf16 as uint16 bits without ml_dtypes)."""
    if code == 1:
        return _F16
    if code == 3:
        return _F32
    if code == 2:
        return _BF16 if _BF16 is not None else np.dtype("<u2")
    raise InvalidArgumentError(f"no float dtype with code {code}")


cdef inline size_t _itemsize(int code):
    return 4 if code == 3 or code == 0 else 2


cdef inline size_t _row_bytes(int code, uint32_t dim):
    """Bytes of one gist row: d elements, or for q8 ceil(d/32) f16 scales + 32 codes per block."""
    cdef size_t nb
    if code == Q8:
        nb = (<size_t>dim + Q8_BLOCK - 1) // Q8_BLOCK
        return nb * (2 + Q8_BLOCK)
    return dim * _itemsize(code)


def q8_row_bytes(uint32_t dim):
    return _row_bytes(Q8, dim)


def quantize_q8(rows, impl=None):
    """Quantize float32 rows [n, d] (finite) to q8 gist rows [n, ceil(d/32) * 34] (uint8): per row the
    f16 block scales, then the int8 codes, with MCF's error-minimizing q8 quantizer (csrc/quant_search.c),
    exactly the scales and codes ``mcf.quantize(rows, "q8")`` writes for those rows."""
    a = np.ascontiguousarray(_native(np.asarray(rows)), dtype=np.float32)
    if a.ndim != 2 or a.shape[1] == 0 or a.shape[1] > 0xFFFF:
        raise InvalidArgumentError(f"q8 rows must be [n, d] with 1 <= d <= 65535, got shape {a.shape}")
    if a.size and not np.isfinite(a).all():
        k = int(np.flatnonzero(~np.isfinite(a).all(axis=1))[0])
        raise InvalidArgumentError(f"gist row {k} holds NaN or Inf, which q8 cannot store")
    cdef size_t n = a.shape[0], d = a.shape[1]
    cdef size_t nb = (d + Q8_BLOCK - 1) // Q8_BLOCK
    out = np.zeros((n, nb * (2 + Q8_BLOCK)), dtype=np.uint8)
    if n == 0:
        return out
    scales = np.empty((n, nb), dtype=np.uint16)
    codes = np.empty((n, nb * Q8_BLOCK), dtype=np.uint8)
    cdef int im = _resolve_impl(impl), rc
    cdef uintptr_t sp = a.ctypes.data, scp = scales.ctypes.data, cp = codes.ctypes.data
    cdef float inf = float("inf")
    with nogil:
        rc = mcf_quantize_rows_search(1, 8, <const float*>sp, n, d, -inf, inf, NULL, <uint16_t*>scp, NULL,
                                      <uint8_t*>cp, im)
    if rc != 0:
        raise InvalidArgumentError("a gist value is too large for q8 (its block scale overflows float16: "
                                   "|x| > 65504 * 127)")
    out[:, :2 * nb] = scales.view(np.uint8).reshape(n, 2 * nb)
    out[:, 2 * nb:] = codes
    return out


def decode_q8(rows, uint32_t dim, out, impl=None):
    """Decode q8 gist rows ([n, row_bytes] uint8, in memory) into ``out`` ([n, dim] float16, bfloat16 or
    float32) with MCF's dequantization kernel."""
    r = np.ascontiguousarray(rows, dtype=np.uint8)
    cdef size_t rb = _row_bytes(Q8, dim)
    if dim == 0 or r.ndim != 2 or <size_t>r.shape[1] != rb:
        raise InvalidArgumentError(f"q8 rows of {dim} values are {rb} bytes wide, got shape {r.shape}")
    cdef int oc = float_code(out.dtype) if isinstance(out, np.ndarray) else -1
    if oc < 0:
        raise InvalidArgumentError("out must be a float16, bfloat16 or float32 array")
    check_out(out, "out")
    if out.shape != (r.shape[0], dim) or not out.flags.c_contiguous:
        raise InvalidArgumentError(f"out must be C-contiguous of shape ({r.shape[0]}, {dim}), got {out.shape}")
    cdef size_t n = r.shape[0], k, ob = dim * _itemsize(oc)
    cdef int im = _resolve_impl(impl)
    cdef uintptr_t sp = r.ctypes.data if n else 0, dp = out.ctypes.data if n else 0
    with nogil:
        for k in range(n):
            mc_decode_q8_row(<const uint8_t*>sp + k * rb, dim, <uint8_t*>dp + k * ob, oc, im)
    return out


def gather_q8(Source src, uint64_t count, uint32_t dim, indices, out, impl=None):
    """Decode rows ``indices`` (int64, each < count) of a q8 gist file into ``out`` ([n, dim] float16,
    bfloat16 or float32, C-contiguous): straight from the mapping, or one positional read per row."""
    ix = np.ascontiguousarray(indices, dtype=np.int64)
    if ix.ndim != 1:
        raise InvalidArgumentError("indices must be 1-D")
    cdef size_t rb = _row_bytes(Q8, dim)
    cdef Py_ssize_t n = ix.shape[0], k
    if n and (ix.min() < 0 or ix.max() >= <int64_t>count):
        bad = ix[(ix < 0) | (ix >= <int64_t>count)][0]
        raise OutOfBoundsError(f"{src.name}: row {int(bad)} is outside the file's {count} committed rows")
    src.check_range(HEADER, count * rb)
    cdef int oc = float_code(out.dtype) if isinstance(out, np.ndarray) else -1
    if oc < 0:
        raise InvalidArgumentError("out must be a float16, bfloat16 or float32 array")
    check_out(out, "out")
    if out.shape != (n, dim) or not out.flags.c_contiguous:
        raise InvalidArgumentError(f"out must be C-contiguous of shape ({n}, {dim}), got {out.shape}")
    if n == 0:
        return out
    cdef int64_t[::1] iv = ix
    cdef uint8_t* dst = <uint8_t*><uintptr_t>out.ctypes.data
    cdef size_t ob = dim * _itemsize(oc)
    cdef const uint8_t* base = src.base
    cdef int im = _resolve_impl(impl)
    keep = src._mapping  # alive while the GIL is released
    cdef uint8_t[::1] tmp
    if base != NULL:
        with nogil:
            for k in range(n):
                mc_decode_q8_row(base + HEADER + <uint64_t>iv[k] * rb, dim, dst + k * ob, oc, im)
    else:
        scratch = np.empty(rb, dtype=np.uint8)
        tmp = scratch
        for k in range(n):
            src.copy_to(HEADER + <uint64_t>iv[k] * rb, rb, &tmp[0])
            mc_decode_q8_row(&tmp[0], dim, dst + k * ob, oc, im)
    return out


cdef int _check_level_source(Source src, uint64_t count, uint64_t entry, str what) except -1:
    if src is None:
        raise InvalidArgumentError(f"{what}: no source")
    # the whole committed range must lie in the file as the source sees it
    src.check_range(HEADER, count * entry)
    return 0


cdef _native(a):
    """An input array in native byte order: big-endian values are values (a converted copy)."""
    return a.astype(a.dtype.newbyteorder("=")) if a.dtype.byteorder == ">" else a


cdef _table_info(table, uint32_t dim):
    """(array, code, vocab, row stride in bytes) of an embedding table; rows must be contiguous."""
    t = _native(table if isinstance(table, np.ndarray) else np.asarray(table))
    if t.ndim != 2:
        raise InvalidArgumentError(f"the embedding table must be 2-D [vocab, d], got shape {t.shape}")
    if t.shape[1] != dim:
        raise InvalidArgumentError(f"the embedding table is {t.shape[1]} wide, the tree's embedding_dim is {dim}")
    code = float_code(t.dtype)
    if code < 0:
        raise InvalidArgumentError(f"embedding table dtype {t.dtype} is not float16, bfloat16 or float32")
    if t.shape[0] and (t.strides[1] != t.dtype.itemsize or t.strides[0] < t.dtype.itemsize * dim):
        t = np.ascontiguousarray(t)
    return t, code, t.shape[0], t.strides[0]


# Outputs at least this large are written with non-temporal stores: a working context is handed to a
# model (or a device copy), not read back at once, and streaming stores skip the read-for-ownership.
STREAM_BYTES = 8 << 20


cdef struct _Copy:            # the copy loop of one assembly, for the row split (_kernel_args.run_split)
    const mc_assembly* a
    int stream


cdef void _copy_rows(const void* job, size_t r0, size_t r1) noexcept nogil:
    cdef const _Copy* j = <const _Copy*>job
    mc_copy_rows(j.a, r0, r1, j.stream)


def assemble(tuple sources, tuple counts, uint32_t block_size, uint32_t dim, tuple gist_codes,
             plan_levels, plan_index, table=None, out=None, out_dtype=None, threads=1, impl=None):
    """Gather a working context in one pass.

    ``sources`` = (LOD0, LOD1, LOD2) :class:`mcf.io.Source` (LOD1/LOD2 may be None when the plan has
    no entry there), ``counts`` = committed (tokens, LOD1 gists, LOD2 gists); the plan is two equal
    length arrays (levels 0/1/2, index within the level; an LOD0 index is a block).  Returns
    ``(levels, positions, token_ids, gists, matrix)``: ``gists`` [n_gist_rows, d] when no ``table`` is
    given, else None and ``matrix`` [n, d] holds token embeddings and gist rows in plan order.
    ``gist_codes`` = (LOD1, LOD2) dtype codes; q8 rows are decoded in the copy loop (variant ``impl``).
    Without a table the gist rows come out in ``out_dtype``, by default the levels' common float dtype,
    float32 when a level is q8 or the levels differ.
    """
    cdef Source s0 = sources[0], s1 = sources[1], s2 = sources[2]
    cdef uint64_t T = counts[0], n1 = counts[1], n2 = counts[2]
    if len(gist_codes) != 2 or any(c not in (1, 2, 3, 4) for c in gist_codes):
        raise InvalidArgumentError(f"bad gist dtype codes {gist_codes!r}")
    cdef int c1 = gist_codes[0], c2 = gist_codes[1]
    cdef size_t grow1 = _row_bytes(c1, dim), grow2 = _row_bytes(c2, dim)
    cdef size_t grow = max(grow1, grow2)
    cdef int im = _resolve_impl(impl)
    cdef Py_ssize_t nt = thread_count(threads)
    if block_size == 0 or dim == 0:
        raise InvalidArgumentError("block_size and dim must be >= 1")
    lv = np.ascontiguousarray(plan_levels)
    ix = np.ascontiguousarray(plan_index)
    if lv.ndim != 1 or ix.ndim != 1 or lv.shape[0] != ix.shape[0]:
        raise InvalidArgumentError("the plan's levels and indices must be 1-D and of equal length")
    if lv.shape[0] and (lv.dtype.kind not in "iu" or ix.dtype.kind not in "iu"):
        raise InvalidArgumentError("the plan's levels and indices must be integers")
    lv64 = lv.astype(np.int64, copy=False)
    if lv.dtype == np.uint64 or ix.dtype == np.uint64:
        if lv.shape[0] and (lv.max() > 2 or ix.max() > 2**62):
            raise OutOfBoundsError("plan index out of range")
    ix = ix.astype(np.int64, copy=False)
    cdef Py_ssize_t m = lv.shape[0]
    if m and ((lv64 < 0) | (lv64 > 2)).any():
        k = int(np.flatnonzero((lv64 < 0) | (lv64 > 2))[0])
        raise InvalidArgumentError(f"plan entry {k}: unknown level {int(lv64[k])} (expected 0, 1 or 2)")
    nblocks = (T + block_size - 1) // block_size
    limit = np.where(lv64 == 0, nblocks, np.where(lv64 == 1, n1, n2)).astype(np.int64) if m else lv64
    if m and ((ix < 0) | (ix >= limit)).any():
        k = int(np.flatnonzero((ix < 0) | (ix >= limit))[0])
        what = ("blocks", "LOD1 gists", "LOD2 gists")[int(lv64[k])]
        raise OutOfBoundsError(f"plan entry {k}: index {int(ix[k])} at level {int(lv64[k])} is outside the "
                               f"tree ({int(limit[k])} {what})")
    lv8 = lv64.astype(np.uint8)
    is_tok = lv8 == 0
    rows = np.ones(m, dtype=np.int64)
    if m:
        rows[is_tok] = np.minimum(block_size, T - ix[is_tok] * block_size)
    out_row = np.zeros(m, dtype=np.int64)
    if m > 1:
        np.cumsum(rows[:-1], out=out_row[1:])
    n = int(rows.sum()) if m else 0
    tok_rows = np.where(is_tok, rows, 0)
    n_tok = int(tok_rows.sum()) if m else 0
    n_gist = n - n_tok
    out_slot = np.zeros(m, dtype=np.int64)
    if m:
        tslot = np.cumsum(tok_rows) - tok_rows
        gslot = np.cumsum(~is_tok) - (~is_tok)
        out_slot = np.where(is_tok, tslot, gslot).astype(np.int64)

    # sources: the mapped files, or scratch copies made with one positional read per entry
    cdef bint need1 = m and bool((lv8 == 1).any()), need2 = m and bool((lv8 == 2).any())
    _check_level_source(s0, T, 4, "LOD0")
    if need1:
        _check_level_source(s1, n1, grow1, "LOD1")
    if need2:
        _check_level_source(s2, n2, grow2, "LOD2")
    cdef bint mapped = s0.base != NULL and (not need1 or s1.base != NULL) and (not need2 or s2.base != NULL)
    # The mappings behind the base pointers stay alive until the copies end: another thread may call
    # Source.refresh() (a Tree refresh remaps a grown file) or close() while the GIL is released.
    keep = (s0._mapping if s0 is not None else None, s1._mapping if s1 is not None else None,
            s2._mapping if s2 is not None else None)
    cdef mc_assembly a
    cdef Py_ssize_t e
    cdef int64_t[::1] ix_v = ix, rows_v = rows, slot_v = out_slot
    cdef uint8_t[::1] lv_v = lv8
    cdef uint8_t[:, ::1] tmp_g
    cdef uint32_t[::1] tmp_t
    if mapped:
        src_first = np.where(is_tok, ix * block_size, ix).astype(np.int64) if m else ix
        a.tokens = <const uint32_t*>(s0.base + HEADER)
        a.gists[0] = NULL
        a.gists[1] = (s1.base + HEADER) if need1 else NULL
        a.gists[2] = (s2.base + HEADER) if need2 else NULL
        a.gist_stride[1] = grow1
        a.gist_stride[2] = grow2
    else:
        src_first = out_slot
        scratch_t = np.empty(max(n_tok, 1), dtype=np.uint32)
        scratch_g = np.empty((max(n_gist, 1), grow), dtype=np.uint8)
        tmp_t = scratch_t
        tmp_g = scratch_g
        for e in range(m):
            if lv_v[e] == 0:
                s0.copy_to(HEADER + <uint64_t>ix_v[e] * block_size * 4, <size_t>rows_v[e] * 4, &tmp_t[slot_v[e]])
            elif lv_v[e] == 1:
                s1.copy_to(HEADER + <uint64_t>ix_v[e] * grow1, grow1, &tmp_g[slot_v[e], 0])
            else:
                s2.copy_to(HEADER + <uint64_t>ix_v[e] * grow2, grow2, &tmp_g[slot_v[e], 0])
        a.tokens = &tmp_t[0]
        a.gists[0] = NULL
        a.gists[1] = &tmp_g[0, 0]
        a.gists[2] = &tmp_g[0, 0]
        a.gist_stride[1] = grow   # the scratch rows are as wide as the wider level's
        a.gist_stride[2] = grow

    levels = np.empty(n, dtype=np.uint8)
    positions = np.empty(n, dtype=np.int64)
    token_ids = np.empty(n_tok, dtype=np.uint32)
    gists = None
    matrix = None
    cdef int ocode = c1 if c1 == c2 and c1 != Q8 else 3
    if table is not None:
        t, tcode, vocab, tstride = _table_info(table, dim)
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise InvalidArgumentError("out must be a numpy array")
            ocode = float_code(out.dtype)
            if byte_order_problem(out.dtype, "out"):
                raise InvalidArgumentError(byte_order_problem(out.dtype, "out"))
            if ocode < 0:
                raise InvalidArgumentError(f"out dtype {out.dtype} is not float16, bfloat16 or float32")
            if out_dtype is not None and float_code(out_dtype) != ocode:
                raise InvalidArgumentError(f"out is {out.dtype}, dtype asks for {np.dtype(out_dtype)}")
            if out.ndim != 2 or out.shape[0] < n or out.shape[1] != dim:
                raise InvalidArgumentError(f"out must have shape ({n}, {dim}) or more rows, got {out.shape}")
            check_out(out, "out")
            matrix = out[:n]
        else:
            ocode = tcode if out_dtype is None else float_code(out_dtype)
            if ocode < 0:
                raise InvalidArgumentError(f"dtype {out_dtype!r} is not float16, bfloat16 or float32")
            matrix = np.empty((n, dim), dtype=numpy_dtype(ocode))
        a.table = <const uint8_t*><uintptr_t>(t.ctypes.data) if t.shape[0] else NULL
        a.vocab = vocab
        a.table_dtype = tcode
        a.table_row_stride = tstride
        a.matrix = <uint8_t*><uintptr_t>(matrix.ctypes.data) if n else NULL
        a.gists_out = NULL
    else:
        if out is not None:
            raise InvalidArgumentError("out needs an embedding table")
        if out_dtype is not None:
            ocode = float_code(out_dtype)
            if ocode < 0:
                raise InvalidArgumentError(f"dtype {out_dtype!r} is not float16, bfloat16 or float32")
        gists = np.empty((n_gist, dim), dtype=numpy_dtype(ocode))
        a.gists_out = <uint8_t*><uintptr_t>(gists.ctypes.data) if n_gist else NULL
        a.matrix = NULL
        a.table = NULL
        a.vocab = 0
        a.table_dtype = 0
        a.table_row_stride = 0
    a.gist_dtype[0] = 0
    a.gist_dtype[1] = c1
    a.gist_dtype[2] = c2
    a.gist_stride[0] = 0
    a.impl = im
    a.dim = dim
    a.block_size = block_size
    a.out_dtype = ocode
    a.out_row_bytes = dim * _itemsize(ocode)
    cdef uint8_t[::1] lv_keep = lv8
    cdef int64_t[::1] ix_keep = ix
    cdef int64_t[::1] sf_keep = np.ascontiguousarray(src_first, dtype=np.int64)
    cdef int64_t[::1] or_keep = out_row
    cdef int64_t[::1] os_keep = out_slot
    if m == 0:
        return levels, positions, token_ids, gists, matrix
    a.plan_level = &lv_keep[0]
    a.plan_index = &ix_keep[0]
    a.src_first = &sf_keep[0]
    a.rows = &rows_v[0]
    a.out_row = &or_keep[0]
    a.out_slot = &os_keep[0]
    cdef uint8_t[::1] lvo = levels
    cdef int64_t[::1] poso = positions
    a.levels = &lvo[0]
    a.positions = &poso[0]
    cdef uint32_t[::1] tido
    a.token_ids = NULL
    if n_tok:
        tido = token_ids
        a.token_ids = &tido[0]
    n_copy = n if matrix is not None else n_gist
    row_src = np.empty(max(n_copy, 1), dtype=np.uintp)
    row_dtype = np.empty(max(n_copy, 1), dtype=np.uint8)
    cdef uint8_t[::1] rdt = row_dtype
    a.row_src = <const uint8_t**><uintptr_t>row_src.ctypes.data
    a.row_dtype = &rdt[0]
    cdef int64_t bad
    cdef size_t ncp = n_copy
    cdef int stream = (n_copy * a.out_row_bytes) >= STREAM_BYTES
    cdef _Copy job = _Copy(&a, stream)
    if nt == 1 or ncp < 2:
        with nogil:
            bad = mc_assemble(&a, <size_t>m, ncp, stream)
    else:
        with nogil:
            bad = mc_plan_rows(&a, 0, <size_t>m)
        if bad < 0:
            run_split(_copy_rows, &job, 0, ncp, nt)
    if bad >= 0:
        # find the token behind output row `bad`
        e = int(np.searchsorted(out_row, bad, side="right")) - 1
        tok = int(token_ids[out_slot[e] + (bad - out_row[e])])
        raise OutOfBoundsError(f"token id {tok} at position {int(ix[e]) * block_size + (bad - int(out_row[e]))} "
                               f"is outside the embedding table ({a.vocab} rows)")
    return levels, positions, token_ids, gists, matrix


def gather_rows(Source src, uint64_t count, size_t row_bytes, indices, out):
    """Copy rows ``indices`` (int64, each < count) of a file of fixed-size rows after the 64-byte header
    into ``out`` (a C-contiguous writable array of len(indices) * row_bytes bytes)."""
    ix = np.ascontiguousarray(indices, dtype=np.int64)
    if ix.ndim != 1:
        raise InvalidArgumentError("indices must be 1-D")
    cdef Py_ssize_t n = ix.shape[0], k
    if n and (ix.min() < 0 or ix.max() >= <int64_t>count):
        bad = ix[(ix < 0) | (ix >= <int64_t>count)][0]
        raise OutOfBoundsError(f"{src.name}: row {int(bad)} is outside the file's {count} committed rows")
    src.check_range(HEADER, count * row_bytes)
    check_out(out, "out")
    if out.nbytes != n * row_bytes:
        raise InvalidArgumentError(f"out holds {out.nbytes} bytes, the rows take {n * row_bytes}")
    if n == 0:
        return out
    cdef int64_t[::1] iv = ix
    cdef uint8_t* dst = <uint8_t*><uintptr_t>out.ctypes.data
    cdef const uint8_t* base = src.base
    keep = src._mapping if src is not None else None  # alive while the GIL is released (a refresh or close elsewhere drops the source's)
    if base != NULL:
        with nogil:
            for k in range(n):
                memcpy(dst + k * row_bytes, base + HEADER + <uint64_t>iv[k] * row_bytes, row_bytes)
    else:
        for k in range(n):
            src.copy_to(HEADER + <uint64_t>iv[k] * row_bytes, row_bytes, dst + k * row_bytes)
    return out


def convert(src, out):
    """Convert a float array into ``out`` (same element count; fp16/bf16/fp32 each way), rounding to
    nearest even."""
    s = np.ascontiguousarray(_native(np.asarray(src)))
    cdef int sc = float_code(s.dtype), dc = float_code(out.dtype)
    if sc < 0 or dc < 0:
        raise InvalidArgumentError(f"cannot convert {s.dtype} to {out.dtype}")
    if out.size != s.size or not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError("out must be C-contiguous, writeable and of the same size")
    cdef size_t n = s.size
    cdef uintptr_t sp = s.ctypes.data, dp = out.ctypes.data
    if n:
        with nogil:
            mc_convert(<const void*>sp, sc, <void*>dp, dc, n)
    return out


def pool_rows(rows, uint32_t group, out_dtype):
    """Mean of each run of ``group`` rows of a [G*group, d] float array -> [G, d] of ``out_dtype``."""
    r = np.ascontiguousarray(_native(np.asarray(rows)))
    cdef int sc = float_code(r.dtype), oc = float_code(out_dtype)
    if sc < 0 or oc < 0:
        raise InvalidArgumentError(f"pooling needs float16, bfloat16 or float32 (got {r.dtype} -> {out_dtype})")
    if r.ndim != 2 or group == 0 or r.shape[0] % group:
        raise InvalidArgumentError(f"rows must be [G*{group}, d], got {r.shape}")
    cdef size_t ng = r.shape[0] // group
    cdef uint32_t d = r.shape[1]
    if <Py_ssize_t>d != r.shape[1]:
        raise InvalidArgumentError("rows are too wide")
    out = np.empty((ng, d), dtype=numpy_dtype(oc))
    if ng == 0 or d == 0:
        return out
    acc = np.empty(d, dtype=np.float64)
    cdef uintptr_t rp = r.ctypes.data, op = out.ctypes.data, ap = acc.ctypes.data
    with nogil:
        mc_pool_rows(<const uint8_t*>rp, sc, ng, group, d, <uint8_t*>op, oc, <double*>ap)
    return out


def pool_tokens(ids, uint32_t group, table, out_dtype):
    """Mean of the embedding-table rows of each run of ``group`` token ids -> [G, d] of ``out_dtype``."""
    iv = np.ascontiguousarray(ids, dtype=np.uint32) if np.asarray(ids).dtype == np.uint32 else None
    if iv is None:
        a = np.asarray(ids)
        if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() > 0xFFFFFFFF):
            raise InvalidArgumentError("token ids must be integers in [0, 2**32)")
        iv = np.ascontiguousarray(a, dtype=np.uint32)
    if iv.ndim != 1 or group == 0 or iv.shape[0] % group:
        raise InvalidArgumentError(f"ids must be 1-D with a multiple of {group} entries, got {iv.shape}")
    t = table if isinstance(table, np.ndarray) else np.asarray(table)
    if t.ndim != 2:
        raise InvalidArgumentError(f"the embedding table must be 2-D [vocab, d], got shape {t.shape}")
    cdef uint32_t d = t.shape[1]
    t, tcode, vocab, tstride = _table_info(t, d)
    cdef int oc = float_code(out_dtype)
    if oc < 0:
        raise InvalidArgumentError(f"dtype {out_dtype!r} is not float16, bfloat16 or float32")
    cdef size_t ng = iv.shape[0] // group
    out = np.empty((ng, d), dtype=numpy_dtype(oc))
    if ng == 0 or d == 0:
        return out
    acc = np.empty(d, dtype=np.float64)
    cdef uintptr_t ip = iv.ctypes.data, tp = t.ctypes.data, op = out.ctypes.data, ap = acc.ctypes.data
    cdef uint64_t voc = vocab
    cdef size_t ts = tstride
    cdef int tc = tcode
    cdef int64_t bad
    with nogil:
        bad = mc_pool_tokens(<const uint32_t*>ip, ng, group, <const uint8_t*>tp, voc, tc, ts, d,
                             <uint8_t*>op, oc, <double*>ap)
    if bad >= 0:
        raise OutOfBoundsError(f"token id {int(iv[bad])} at position {bad} is outside the embedding table "
                               f"({vocab} rows)")
    return out
