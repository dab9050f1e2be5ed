"""Compiled quantization kernels: thin, validating wrappers over csrc/dequant.c and csrc/quantize.c.

Every size, offset and region is checked here, with Python integers, before the C code runs with the
GIL released.  The C variant (scalar / avx2 / avx512 on x86-64, scalar / neon on aarch64) is chosen at run time from the CPU, the
``MCF_FORCE_IMPL`` environment variable, or the ``impl=`` keyword.
"""

import numpy as np

from libc.stdint cimport uint8_t, uint16_t, uint32_t, int8_t, int32_t, uintptr_t

from mcf._core.args import integer, row_range
from mcf._core._io import aligned_empty
from mcf.errors import InvalidArgumentError
from mcf._core._fpconv import IMPLS, env_impl, supported_impls
from mcf._core._buffers cimport check_out, flat_bytes
from mcf._core._kernel_args cimport MCF_OUT_F32, out_kind as _out_kind, rows_job, run_split, thread_count
from mcf._core._fpconv cimport resolve_impl as _resolve_impl
from mcf._core.block_layout import Domain, quant_layout

cdef extern from "cpu.h" nogil:
    int mcf_cpu_best()
    int mcf_cpu_supports(int impl)
    const char* mcf_impl_name(int impl)

cdef extern from "quant.h" nogil:
    enum: MCF_FAM_RAW, MCF_FAM_BLOCK, MCF_FAM_SUPER
    ctypedef struct mcf_qtensor:
        int family
        int bits
        size_t rows, cols, bpr, spr
        const uint16_t* scales
        const uint8_t* sub
        const uint8_t* data
        size_t row_bytes
        float scale, zero
    void mcf_dequant_rows(const mcf_qtensor* t, size_t r0, size_t r1, void* out, int out_kind, int impl)
    void mcf_unpack_rows(const mcf_qtensor* t, size_t r0, size_t r1, int8_t* out, int impl)
    int mcf_quantize_rows(int family, int bits, const float* src, size_t nrows, size_t cols, float min_clip,
                          float max_clip, int compat, uint16_t* scales, uint8_t* sub, uint8_t* codes, int impl)
    int mcf_quantize_rows_search(int family, int bits, const float* src, size_t nrows, size_t cols, float min_clip,
                                 float max_clip, const float* weights, uint16_t* scales, uint8_t* sub, uint8_t* codes,
                                 int impl)
    void mcf_quantize_raw_rows(int bits, const float* src, size_t nrows, size_t cols, float min_clip,
                               float max_clip, float scale, float zero, uint8_t* codes, size_t row_bytes, int impl)
    long long mcf_absmax_finite(const float* src, size_t n, float* absmax, float* minv, float* maxv)
    long long mcf_absmax(const float* src, size_t n, float* absmax, int impl)

_FAMILY = {"raw": MCF_FAM_RAW, "block": MCF_FAM_BLOCK, "super": MCF_FAM_SUPER}


def resolve_impl(impl=None):
    """The variant index to run: ``impl`` if given, else ``$MCF_FORCE_IMPL``, else the best the CPU has.
    Asking for a variant this CPU cannot run is an error, never a silent fallback (the rule lives in
    mcf._core._fpconv, which every compiled module cimports)."""
    return _resolve_impl(impl)


def kernel_info():
    """Which kernel variant runs, and which this CPU supports."""
    best = mcf_cpu_best()
    forced = env_impl()
    try:
        active = IMPLS[resolve_impl()]
    except InvalidArgumentError as exc:
        active = f"error: {exc}"
    return {"active": active, "best": IMPLS[best], "supported": supported_impls(),
            "forced": forced, "env": "MCF_FORCE_IMPL"}


def out_kind(dt):
    """The C kernels' output code of a numpy dtype (MCF_OUT_F32 / _F16 / _BF16 of csrc/fpconv.h; bfloat16
    also as its uint16 bits): the mapping every compiled module cimports (mcf/_core/_kernel_args.pxd), shown
    to Python."""
    return _out_kind(dt)


cdef class _Tensor:
    """A validated view of one quantized payload, ready for the C kernels."""
    cdef mcf_qtensor t
    cdef object keep   # the payload array, kept alive while the pointers are used
    cdef readonly object layout

    def __init__(self, payload, code, rows, cols, domain=Domain.WEIGHTS):
        lay = quant_layout(code, (rows, cols), domain)
        buf = flat_bytes(payload)
        if buf.size < lay.nbytes:
            raise InvalidArgumentError(f"payload has {buf.size} bytes, {lay.dtype.name} {[rows, cols]} needs "
                                       f"{lay.nbytes}")
        self.keep = buf
        self.layout = lay
        cdef uintptr_t base = buf.ctypes.data if buf.size else 0
        self.t.family = _FAMILY[lay.dtype.family]
        self.t.bits = lay.dtype.bits
        self.t.rows = rows
        self.t.cols = cols
        self.t.bpr = lay.blocks_per_row
        self.t.spr = lay.supers_per_row
        self.t.row_bytes = lay.row_bytes
        self.t.scales = NULL
        self.t.sub = NULL
        self.t.scale = 0
        self.t.zero = 0
        for r in lay.regions:
            # quant_layout's regions end inside lay.nbytes <= buf.size (checked above)
            if r.offset + r.size > buf.size:
                raise InvalidArgumentError(f"region {r.name} outside the payload")
            p = base + r.offset
            if r.name in ("scales", "super_scales"):
                self.t.scales = <const uint16_t*><uintptr_t>p
            elif r.name == "sub_scales":
                self.t.sub = <const uint8_t*><uintptr_t>p
            elif r.name == "data":
                self.t.data = <const uint8_t*><uintptr_t>p
            elif r.name == "scale":
                self.t.scale = float(buf[r.offset:r.offset + 4].view("<f4")[0])
            elif r.name == "zero":
                self.t.zero = float(buf[r.offset:r.offset + 4].view("<f4")[0])


cdef class QTensor(_Tensor):
    """A prepared quantized tensor for decoding many small row tiles with little per-call overhead
    (inference runtimes that consume a tile of rows and move on: the output stays in L1/L2)."""
    cdef int _impl

    def __init__(self, payload, code, rows, cols, domain=Domain.WEIGHTS, impl=None):
        _Tensor.__init__(self, payload, code, rows, cols, domain)
        self._impl = _resolve_impl(impl)

    def rows_into(self, r0, r1, out):
        """Decode rows [r0, r1) as float32 into ``out``: a C-contiguous float32 buffer of at least
        (r1-r0)*cols items, flat or shaped (a [rows, cols] tile works as it is)."""
        cdef size_t a = _row(r0, "r0"), b = _row(r1, "r1")
        cdef float[::1] buf
        try:
            buf = out                   # the common case: a flat float32 buffer, no Python-level checks
        except (ValueError, TypeError):
            buf = _flat_f32(out)
        if b < a or b > self.t.rows:
            raise InvalidArgumentError(f"row range ({a}, {b}) outside 0..{self.t.rows}")
        if <size_t>buf.shape[0] < (b - a) * self.t.cols:
            raise InvalidArgumentError("out is too small for the rows")
        if b == a:
            return
        with nogil:
            mcf_dequant_rows(&self.t, a, b, &buf[0], MCF_OUT_F32, self._impl)


    def decode_tiles(self, r0, r1, tile_rows, tile):
        """Decode rows [r0, r1) ``tile_rows`` at a time into the same small float32 buffer ``tile`` (flat
        or shaped, C-contiguous), in one C loop: the access pattern of a consumer that uses each tile and
        moves on (the tile stays in L1/L2).  Returns the number of tiles decoded."""
        cdef size_t a = _row(r0, "r0"), b = _row(r1, "r1"), k = _row(tile_rows, "tile_rows")
        cdef float[::1] buf
        try:
            buf = tile
        except (ValueError, TypeError):
            buf = _flat_f32(tile)
        if b < a or b > self.t.rows:
            raise InvalidArgumentError(f"row range ({a}, {b}) outside 0..{self.t.rows}")
        if k == 0 or <size_t>buf.shape[0] < k * self.t.cols:
            raise InvalidArgumentError("tile must hold tile_rows rows (tile_rows >= 1)")
        cdef size_t r = a, n = 0, e
        with nogil:
            while r < b:
                e = r + k if r + k < b else b
                mcf_dequant_rows(&self.t, r, e, &buf[0], MCF_OUT_F32, self._impl)
                r = e
                n += 1
        return n


cdef inline Py_ssize_t _row(object v, str what) except -1:
    """A row number or count: an integer (a float or a bool is refused, not truncated), >= 0."""
    if type(v) is not int:
        v = integer(v, what)
    if v < 0:
        raise InvalidArgumentError(f"{what} must be >= 0, got {v}")
    return v


cdef inline _flat_f32(out):
    """A C-contiguous float32 array of any shape as the flat buffer the kernels write (the memoryview
    conversion then checks dtype, byte order and writability)."""
    if isinstance(out, np.ndarray) and (<object>out).ndim != 1:
        if not out.flags.c_contiguous:
            raise InvalidArgumentError("out must be C-contiguous")
        return out.reshape(-1)
    return out


def _row_range(rows, total):
    return row_range(rows, total, InvalidArgumentError)


cdef void _dequant_rows(const void* job, size_t a, size_t b) noexcept nogil:
    cdef const rows_job* j = <const rows_job*>job
    mcf_dequant_rows(<const mcf_qtensor*>j.tensor, a, b, j.out + (a - j.r0) * j.row_bytes, j.kind, j.impl)


def dequantize(payload, code, rows, cols, *, domain=Domain.WEIGHTS, dtype=np.float32, row_range=None,
               out=None, impl=None, threads=1):
    """Dequantize a quantized payload (rows ``row_range`` only, default all) to a [n, cols] array."""
    cdef _Tensor qt = _Tensor(payload, code, rows, cols, domain)
    cdef size_t r0, r1
    a, b = _row_range(row_range, rows)
    r0, r1 = a, b
    cdef Py_ssize_t nthreads = thread_count(threads)
    dt = np.dtype(dtype)
    cdef int kind = _out_kind(dt)
    n = (b - a) * cols
    if out is None:  # 64-byte aligned, so large outputs can use streaming stores
        out = aligned_empty((b - a) * cols * dt.itemsize, 64).view(dt).reshape(b - a, cols)
    else:
        check_out(out, "out")
        if out.size != n:
            raise InvalidArgumentError(f"out has {out.size} elements, rows {a}..{b} x {cols} need {n}")
        kind = _out_kind(out.dtype)
    cdef int im = _resolve_impl(impl)
    cdef uintptr_t optr = out.ctypes.data
    cdef size_t esize = out.dtype.itemsize
    cdef size_t c = cols
    if n == 0:
        return out
    cdef rows_job job = rows_job(&qt.t, <char*>optr, r0, c * esize, kind, im)
    run_split(_dequant_rows, &job, r0, r1, nthreads)
    return out


def unpack_codes(payload, code, rows, cols, *, domain=Domain.WEIGHTS, row_range=None, impl=None):
    """The signed integer codes of rows ``row_range`` as int8, [n, blocks_per_row * 32] for q*/k* (the
    padding of each row's last block included) or [n, cols] for int8/int4."""
    cdef _Tensor qt = _Tensor(payload, code, rows, cols, domain)
    a, b = _row_range(row_range, rows)
    width = cols if qt.t.family == MCF_FAM_RAW else qt.t.bpr * 32
    out = np.empty((b - a, width), dtype=np.int8)
    cdef int im = _resolve_impl(impl)
    cdef uintptr_t optr = out.ctypes.data
    cdef size_t r0 = a, r1 = b
    if out.size:
        with nogil:
            mcf_unpack_rows(&qt.t, r0, r1, <int8_t*>optr, im)
    return out


def absmax(src, impl=None):
    """max |x| of a float32 array (any variant gives the same value), or raise if it holds NaN or infinity."""
    cdef const float[::1] s = np.ascontiguousarray(src, dtype=np.float32).reshape(-1)
    cdef float amax = 0
    cdef long long bad
    cdef size_t n = s.shape[0]
    cdef int im = _resolve_impl(impl)
    if n == 0:
        return 0.0
    with nogil:
        bad = mcf_absmax(&s[0], n, &amax, im)
    if bad >= 0:
        raise InvalidArgumentError(f"tensor holds a non-finite value ({s[bad]}) at flat index {bad}; "
                                   "NaN and infinity cannot be quantized")
    return float(amax)


def absmax_finite(src):
    """(max |x|, min, max) of a float32 array, or raise if it holds NaN or infinity."""
    cdef const float[::1] s = np.ascontiguousarray(src, dtype=np.float32).reshape(-1)
    cdef float amax = 0, lo = 0, hi = 0
    cdef long long bad
    cdef size_t n = s.shape[0]
    if n == 0:
        return 0.0, 0.0, 0.0
    with nogil:
        bad = mcf_absmax_finite(&s[0], n, &amax, &lo, &hi)
    if bad >= 0:
        raise InvalidArgumentError(f"tensor holds a non-finite value ({s[bad]}) at flat index {bad}; "
                                   "NaN and infinity cannot be quantized")
    return float(amax), float(lo), float(hi)


def quantize_rows(src, code, out_payload, row0, *, min_clip, max_clip, compat=False, cols=None, rows=None,
                  scale=0.0, zero=0.0, domain=Domain.WEIGHTS, impl=None, search=False, weights=None):
    """Quantize float32 rows ``src`` ([n, cols]) into the regions of ``out_payload`` (the whole
    tensor's payload, laid out for ``rows`` x ``cols``) at rows row0 .. row0 + n.

    q*/k*: ``search=True`` runs the error-minimizing quantizer (csrc/quant_search.c), optionally with
    ``weights`` (float32, one finite value >= 0 per column, weighting that column's squared error);
    ``search=False`` the single-pass one (``compat`` picks its Go-compatible mode)."""
    a = np.ascontiguousarray(src, dtype=np.float32)
    if a.ndim != 2:
        raise InvalidArgumentError("src must be 2-D")
    n, c = a.shape
    cols = c if cols is None else cols
    if c != cols:
        raise InvalidArgumentError(f"src has {c} columns, expected {cols}")
    lay = quant_layout(code, (rows, cols), domain)
    buf = out_payload
    check_out(buf, "out_payload")
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise InvalidArgumentError("out_payload must be a writeable contiguous uint8 array")
    if buf.size < lay.nbytes:
        raise InvalidArgumentError(f"out_payload has {buf.size} bytes, needs {lay.nbytes}")
    if not 0 <= row0 <= row0 + n <= rows:
        raise InvalidArgumentError(f"rows {row0}..{row0 + n} outside 0..{rows}")
    cdef uintptr_t base = buf.ctypes.data
    cdef uintptr_t sp = a.ctypes.data
    cdef size_t nrows = n, ncols = cols
    cdef float lo = min_clip, hi = max_clip, fs = scale, fz = zero
    cdef int fam = _FAMILY[lay.dtype.family], bits = lay.dtype.bits, cm = 1 if compat else 0, rc = 0
    cdef int im = _resolve_impl(impl)
    cdef uintptr_t scales_p = 0, sub_p = 0, codes_p = 0, w_p = 0
    cdef size_t rb = lay.row_bytes
    cdef int srch = 1 if search else 0
    if search and (compat or fam == MCF_FAM_RAW):
        raise InvalidArgumentError("the search quantizer is for q*/k* and has no Go-compatible mode")
    if weights is not None:
        if not search:
            raise InvalidArgumentError("weights need the search quantizer (search=True)")
        wa = weights
        if not isinstance(wa, np.ndarray) or wa.dtype != np.float32 or wa.ndim != 1 or not wa.flags.c_contiguous:
            raise InvalidArgumentError("weights must be a contiguous 1-D float32 array")
        if wa.shape[0] != cols:
            raise InvalidArgumentError(f"weights has {wa.shape[0]} values, the tensor has {cols} columns")
        if cols and not (np.isfinite(wa).all() and (wa >= 0).all()):
            raise InvalidArgumentError("weights must be finite and >= 0")
        w_p = wa.ctypes.data if cols else 0
    if nrows == 0:
        return
    reg = {r.name: r for r in lay.regions}
    if fam == MCF_FAM_RAW:
        codes_p = base + reg["data"].offset + row0 * lay.row_bytes
        with nogil:
            mcf_quantize_raw_rows(bits, <const float*>sp, nrows, ncols, lo, hi, fs, fz, <uint8_t*>codes_p, rb, im)
        return
    bb = bits * 4
    codes_p = base + reg["data"].offset + row0 * lay.blocks_per_row * bb
    if fam == MCF_FAM_BLOCK:
        scales_p = base + reg["scales"].offset + 2 * row0 * lay.blocks_per_row
    else:
        scales_p = base + reg["super_scales"].offset + 2 * row0 * lay.supers_per_row
        sub_p = base + reg["sub_scales"].offset + row0 * lay.blocks_per_row
    with nogil:
        if srch:
            rc = mcf_quantize_rows_search(fam, bits, <const float*>sp, nrows, ncols, lo, hi, <const float*>w_p,
                                          <uint16_t*>scales_p, <uint8_t*>sub_p, <uint8_t*>codes_p, im)
        else:
            rc = mcf_quantize_rows(fam, bits, <const float*>sp, nrows, ncols, lo, hi, cm, <uint16_t*>scales_p,
                                   <uint8_t*>sub_p, <uint8_t*>codes_p, im)
    if rc != 0:
        raise InvalidArgumentError("values too large: a block scale overflows float16")


cdef extern from "quant.h" nogil:
    void mcf_pack_block(const int32_t* q, int bits, uint8_t* dst)


def pack_codes(codes, code, out_payload, row0, *, rows, cols):
    """Write the given signed codes of rows row0 .. row0 + n into the code region of ``out_payload`` (a q*/k*
    payload laid out for ``rows`` x ``cols``), packed as the quantizers pack them; the scale regions are left
    as they are.  ``codes`` is int8 [n, blocks_per_row * 32] (each row's last block padded), every code within
    the method's range -2^(bits-1) .. 2^(bits-1) - 1.  For quantizers that choose codes themselves for scales
    chosen by the search (the error feedback of :mod:`mcf.container.error_feedback`): the decoder then
    returns scale * code for every value."""
    rows = integer(rows, "rows", minimum=0)
    cols = integer(cols, "cols", minimum=0)
    row0 = integer(row0, "row0", minimum=0)
    lay = quant_layout(code, (rows, cols), Domain.WEIGHTS)
    if lay.dtype.family == "raw":
        raise InvalidArgumentError(f"pack_codes packs the block codes of the q*/k* methods, not {lay.dtype.name}")
    q = codes
    if not isinstance(q, np.ndarray) or q.dtype != np.int8 or q.ndim != 2 or not q.flags.c_contiguous:
        raise InvalidArgumentError("codes must be a contiguous 2-D int8 array")
    n, width = q.shape
    if width != lay.blocks_per_row * 32:
        raise InvalidArgumentError(f"codes has {width} columns; {lay.dtype.name} rows of {cols} values hold "
                                   f"{lay.blocks_per_row} blocks of 32 codes ({lay.blocks_per_row * 32})")
    if not row0 + n <= rows:
        raise InvalidArgumentError(f"rows {row0}..{row0 + n} outside 0..{rows}")
    qmin, qmax = -(1 << (lay.dtype.bits - 1)), (1 << (lay.dtype.bits - 1)) - 1
    if q.size and (int(q.min()) < qmin or int(q.max()) > qmax):
        raise InvalidArgumentError(f"codes must lie in {qmin}..{qmax} for {lay.dtype.name}, got "
                                   f"{int(q.min())}..{int(q.max())}")
    buf = out_payload
    check_out(buf, "out_payload")
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise InvalidArgumentError("out_payload must be a writeable contiguous uint8 array")
    if buf.size < lay.nbytes:
        raise InvalidArgumentError(f"out_payload has {buf.size} bytes, {lay.dtype.name} {[rows, cols]} needs "
                                   f"{lay.nbytes}")
    if q.size == 0:
        return
    reg = {r.name: r for r in lay.regions}
    cdef size_t bb = lay.dtype.bits * 4, nblocks = <size_t>n * lay.blocks_per_row, b
    cdef int bits = lay.dtype.bits
    cdef uintptr_t dst = buf.ctypes.data + reg["data"].offset + row0 * lay.blocks_per_row * bb
    cdef const int8_t* src = <const int8_t*><uintptr_t>q.ctypes.data
    cdef int32_t block[32]
    cdef int i
    with nogil:
        for b in range(nblocks):
            for i in range(32):
                block[i] = src[b * 32 + i]
            mcf_pack_block(block, bits, <uint8_t*>(dst + b * bb))


from libc.math cimport rintf


def feedback_batch(wt, st, inv, u, codes, err, c0, c1, bits):
    """Columns c0 .. c1 - 1 of error feedback (:func:`mcf.container.error_feedback.feedback_codes`, which owns
    the method), on the transposed working weights ``wt`` (float64 [cols, n], updated in place): for each
    column c, ``codes[c] = clamp(rint(float32(wt[c]) * inv[c]), qmin, qmax)`` (float32 arithmetic, as the
    search quantizer rounds), ``err[c - c0] = (wt[c] - float64(st[c]) * codes[c]) / u[c, c]``, then
    ``wt[k] -= u[c, k] * err[c - c0]`` for k in c + 1 .. c1 - 1, the same IEEE operations in the same order as
    the numpy statement of the method (no fused multiply-add: the build has -ffp-contract=off).  Shapes and
    dtypes are checked here; the loop runs without the GIL."""
    for name, a, dt in (("wt", wt, np.float64), ("st", st, np.float32), ("inv", inv, np.float32),
                        ("u", u, np.float64), ("codes", codes, np.int8), ("err", err, np.float64)):
        if not isinstance(a, np.ndarray) or a.dtype != dt or a.ndim != 2 or not a.flags.c_contiguous:
            raise InvalidArgumentError(f"{name} must be a contiguous 2-D {np.dtype(dt).name} array")
    for name, a in (("wt", wt), ("codes", codes), ("err", err)):
        if not a.flags.writeable:
            raise InvalidArgumentError(f"{name} must be writeable")
    cols, n = wt.shape
    a0, a1 = integer(c0, "c0", minimum=0), integer(c1, "c1", minimum=0)
    b = integer(bits, "bits", minimum=2)
    if b > 8:
        raise InvalidArgumentError(f"bits must be 2..8, got {b}")
    if st.shape != (cols, n) or inv.shape != (cols, n) or codes.shape != (cols, n):
        raise InvalidArgumentError(f"st, inv and codes must have the shape of wt {(cols, n)}, got {st.shape}, "
                                   f"{inv.shape}, {codes.shape}")
    if u.shape != (cols, cols):
        raise InvalidArgumentError(f"u must be ({cols}, {cols}), got {u.shape}")
    if not a0 <= a1 <= cols or err.shape[0] < a1 - a0 or err.shape[1] != n:
        raise InvalidArgumentError(f"columns {a0}..{a1} of {cols}, err {err.shape}: out of range")
    cdef double[:, ::1] w_ = wt
    cdef const float[:, ::1] s_ = st
    cdef const float[:, ::1] i_ = inv
    cdef const double[:, ::1] u_ = u
    cdef int8_t[:, ::1] q_ = codes
    cdef double[:, ::1] e_ = err
    cdef Py_ssize_t c, k, r, nn = n, lo = a0, hi = a1
    cdef float qmin = -(1 << (b - 1)), qmax = (1 << (b - 1)) - 1, xf, q
    cdef double x, d, ukc, FMAX = 3.4028234663852886e38
    if nn == 0:
        return
    with nogil:
        for c in range(lo, hi):
            d = u_[c, c]
            for r in range(nn):
                x = w_[c, r]
                # a double beyond the float32 range converts to +-inf in numpy; in C that is undefined: clamp
                xf = <float>(FMAX if x > FMAX else (-FMAX if x < -FMAX else x))
                q = rintf(xf * i_[c, r])
                q = qmin if q < qmin else (qmax if q > qmax else q)
                q_[c, r] = <int8_t>q
                e_[c - lo, r] = (x - <double>s_[c, r] * <double>q) / d
            for k in range(c + 1, hi):
                ukc = u_[c, k]
                for r in range(nn):
                    w_[k, r] -= ukc * e_[c - lo, r]


cdef extern from "yardstick.h" nogil:
    void mcf_store_yardstick(const uint8_t* src, uint32_t* dst, size_t n, int streaming)


def _store_yardstick(src, out, streaming=True):
    """The benchmarks' store limit (csrc/yardstick.c): every byte of ``src`` widened into a 32-bit lane of
    ``out``, with streaming stores or plain ones.  Not a public API."""
    cdef const uint8_t[::1] s = flat_bytes(src)
    check_out(out, "out")
    if out.dtype.itemsize != 4 or out.size != s.shape[0]:
        raise InvalidArgumentError(f"out must be a C-contiguous array of {s.shape[0]} 4-byte elements, "
                                   f"got {out.size} of {out.dtype}")
    cdef uintptr_t op = out.ctypes.data, sp = <uintptr_t>&s[0] if s.shape[0] else 0
    cdef size_t n = s.shape[0]
    cdef int st = bool(streaming)
    with nogil:
        mcf_store_yardstick(<const uint8_t*>sp, <uint32_t*>op, n, st)
