"""Compiled decoders of mcf's extension dtypes (docs/mcf.md, "mcf extensions"): thin, validating wrappers over
csrc/mx.c.  The payloads' regions come from :mod:`mcf._core.scaled`.

- :func:`decode_elements`: FP8 (E4M3, E5M2 and their FNUZ variants), E8M0 and FP4 (E2M1) values to float32,
  float16 or bfloat16.
- :func:`dequantize`: the block-scaled payloads (mxfp4, nvfp4, f8_e4m3_b128) to the same, a row range at a time.

Every size and region is checked here, with Python integers, and every block scale of the rows asked for is
checked for NaN (an E8M0 0xFF, an E4M3 NaN, a float32 NaN would make its whole block NaN: the payload is
refused with the index of the first such scale), before the C code runs with the GIL released.  The variant
(scalar / avx2 / avx512 / neon) is chosen as for every kernel: ``impl=``, ``MCF_FORCE_IMPL``, or the CPU.
"""

import numpy as np

from libc.stdint cimport uint8_t, uintptr_t

from mcf._core.args import integer, row_range as _row_range
from mcf._core._io import aligned_empty
from mcf._core.dtypes import DType, parse_dtype
from mcf.errors import DTypeError, FormatError, InvalidArgumentError
from mcf._core._buffers cimport check_out, flat_bytes
from mcf._core._kernel_args cimport out_kind, rows_job, run_split, thread_count
from mcf._core._fpconv cimport resolve_impl
from mcf._core.scaled import nan_scales, scaled_layout

cdef extern from "mx.h" nogil:
    enum: MCF_MX_MXFP4, MCF_MX_NVFP4, MCF_MX_F8B128
    enum: MCF_EL_E4M3, MCF_EL_E5M2, MCF_EL_E4M3FNUZ, MCF_EL_E5M2FNUZ, MCF_EL_E8M0, MCF_EL_E2M1
    ctypedef struct mcf_mxtensor:
        int kind
        size_t rows, cols
        const uint8_t* scales
        const uint8_t* data
        float glob "global"
    void mcf_mx_dequant_rows(const mcf_mxtensor* t, size_t r0, size_t r1, void* out, int out_kind, int impl)
    void mcf_decode_elements(int fmt, const uint8_t* src, size_t n, void* out, int out_kind, int impl)

_KINDS = {DType.MXFP4: MCF_MX_MXFP4, DType.NVFP4: MCF_MX_NVFP4, DType.F8_E4M3_B128: MCF_MX_F8B128}
_ELEMENTS = {DType.F8_E4M3: MCF_EL_E4M3, DType.F8_E5M2: MCF_EL_E5M2, DType.F8_E4M3FNUZ: MCF_EL_E4M3FNUZ,
             DType.F8_E5M2FNUZ: MCF_EL_E5M2FNUZ, DType.F8_E8M0: MCF_EL_E8M0, DType.F4: MCF_EL_E2M1}

#: the codes :func:`dequantize` decodes (block-scaled payloads) and :func:`decode_elements` decodes (elements)
SCALED_CODES = frozenset(_KINDS)
ELEMENT_CODES = frozenset(_ELEMENTS)


def _new_out(n, dt, shape):
    """A fresh 64-byte-aligned output (large float32 outputs may then take streaming stores)."""
    return aligned_empty(n * dt.itemsize, 64).view(dt).reshape(shape)


def decode_elements(src, code, *, count=None, dtype=np.float32, out=None, impl=None):
    """The values of a plain FP8 / E8M0 / F4 tensor's bytes ``src`` (any buffer) as a flat float array.

    ``code``: the dtype (a :class:`mcf.DType`, its code or name); ``count``: how many values (default: every
    byte's; F4 holds two per byte, element 2k in the low nibble of byte k); ``dtype``/``out``: float32, float16
    or bfloat16 (``out`` any writeable C-contiguous array of ``count`` values, returned).  NaN encodings decode
    to NaN, exactly as torch and ml_dtypes convert these types."""
    info = parse_dtype(code)
    fmt = _ELEMENTS.get(info.code)
    if fmt is None:
        raise DTypeError(f"{info.name} is not an FP8, E8M0 or F4 element type")
    buf = flat_bytes(src)
    per_byte = 2 if fmt == MCF_EL_E2M1 else 1
    n = buf.size * per_byte if count is None else integer(count, "count", minimum=0)
    if -(-n // per_byte) > buf.size:
        raise InvalidArgumentError(f"{n} {info.name} values need {-(-n // per_byte)} bytes, the buffer has {buf.size}")
    dt = np.dtype(dtype if out is None else out.dtype)
    cdef int kind = out_kind(dt)
    if out is None:
        out = _new_out(n, dt, (n,))
    else:
        check_out(out, "out")
        if out.size != n:
            raise InvalidArgumentError(f"out has {out.size} elements, {n} values need {n}")
    cdef int im = resolve_impl(impl), f = fmt
    cdef uintptr_t sp = buf.ctypes.data if buf.size else 0, op = out.ctypes.data
    cdef size_t cn = n
    if n:
        with nogil:
            mcf_decode_elements(f, <const uint8_t*>sp, cn, <void*>op, kind, im)
    return out


def first_nan_scale(payload, code, shape, *, rows=None):
    """``(where, bits)`` of the first NaN block scale of ``payload`` among payload rows ``rows`` (a
    ``(start, stop)`` pair; None: all): ``where`` names the region and index ("scales[12]", "scale"),
    ``bits`` is the stored value; None when every scale is a number."""
    info = parse_dtype(code)
    lay = scaled_layout(info, shape)
    buf = flat_bytes(payload)
    if buf.size < lay.nbytes:
        raise InvalidArgumentError(f"payload has {buf.size} bytes, {info.name} {list(shape)} needs {lay.nbytes}")
    a, b = (0, lay.rows) if rows is None else rows
    if info.family == "nvfp4" and nan_scales(info, "scale", buf[0:4]).size:
        return "scale", f"0x{int(buf[0:4].view('<u4')[0]):08x}"
    _, off, _, _, _ = lay.region("scales")
    if info.family == "fp8block":   # float32 scales, a row of them per 128 rows
        s0, s1, item = a // 128 * lay.blocks_per_row, -(-b // 128) * lay.blocks_per_row, 4
    else:
        s0, s1, item = a * lay.blocks_per_row, b * lay.blocks_per_row, 1
    part = buf[off + s0 * item:off + s1 * item]
    bad = nan_scales(info, "scales", part)
    if not bad.size:
        return None
    k = int(bad[0])
    return f"scales[{s0 + k}]", "0x" + bytes(part[k * item:(k + 1) * item][::-1]).hex()


cdef class _Scaled:
    """A validated view of one block-scaled payload, ready for the C kernel."""
    cdef mcf_mxtensor t
    cdef object keep
    cdef readonly object layout

    def __init__(self, payload, info, shape):
        lay = scaled_layout(info, shape)
        buf = flat_bytes(payload)
        if buf.size < lay.nbytes:
            raise InvalidArgumentError(f"payload has {buf.size} bytes, {info.name} {list(shape)} needs {lay.nbytes}")
        self.keep = buf
        self.layout = lay
        cdef uintptr_t base = buf.ctypes.data if buf.size else 0
        self.t.kind = _KINDS[info.code]
        self.t.rows = lay.rows
        self.t.cols = lay.cols
        self.t.glob = 0
        for name, off, _, _, _ in lay.regions:   # they end inside lay.nbytes <= buf.size (checked above)
            if name == "scales":
                self.t.scales = <const uint8_t*><uintptr_t>(base + off)
            elif name == "data":
                self.t.data = <const uint8_t*><uintptr_t>(base + off)
            elif name == "scale":
                self.t.glob = float(buf[off:off + 4].view("<f4")[0])


cdef void _dequant_rows(const void* job, size_t a, size_t b) noexcept nogil:
    cdef const rows_job* j = <const rows_job*>job
    mcf_mx_dequant_rows(<const mcf_mxtensor*>j.tensor, a, b, j.out + (a - j.r0) * j.row_bytes, j.kind, j.impl)


def dequantize(payload, code, shape, *, dtype=np.float32, row_range=None, out=None, impl=None, threads=1):
    """Decode an mxfp4 / nvfp4 / f8_e4m3_b128 payload of tensor shape ``shape`` (payload rows: every dimension
    but the last) to a ``[n, cols]`` float32 / float16 / bfloat16 array, payload rows ``row_range`` only
    (default all), into ``out`` (any writeable C-contiguous array of that many values) if given.  A NaN block
    scale among those rows is a :class:`mcf.FormatError` naming the scale."""
    info = parse_dtype(code)
    if info.code not in _KINDS:
        raise DTypeError(f"{info.name} is not a block-scaled extension dtype (mxfp4, nvfp4, f8_e4m3_b128)")
    cdef _Scaled st = _Scaled(payload, info, shape)
    rows, cols = st.layout.rows, st.layout.cols
    a, b = _row_range(row_range, rows, InvalidArgumentError)
    cdef Py_ssize_t nthreads = thread_count(threads)
    bad = first_nan_scale(st.keep, info, shape, rows=(a, b))
    if bad is not None:
        raise FormatError("a NaN block scale: every value of its block would decode to NaN", field=bad[0],
                          expected=f"a number ({info.name} scales)", got=bad[1])
    dt = np.dtype(dtype if out is None else out.dtype)
    cdef int kind = out_kind(dt)
    n = (b - a) * cols
    if out is None:
        out = _new_out(n, dt, (b - a, cols))
    else:
        check_out(out, "out")
        if out.size != n:
            raise InvalidArgumentError(f"out has {out.size} elements, rows {a}..{b} x {cols} need {n}")
    cdef int im = resolve_impl(impl)
    cdef uintptr_t optr = out.ctypes.data
    cdef size_t esize = out.dtype.itemsize, c = cols, r0 = a, r1 = b
    if n == 0:
        return out
    cdef rows_job job = rows_job(&st.t, <char*>optr, r0, c * esize, kind, im)
    run_split(_dequant_rows, &job, r0, r1, nthreads)
    return out
