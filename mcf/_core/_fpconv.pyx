"""Compiled float conversions: bfloat16/float16 to and from float32, round to nearest even.

Thin wrappers: they check shapes and dtypes, then release the GIL for the C loops in csrc/fpconv.c.
"""
import os

import numpy as np

from libc.stdint cimport uint16_t, uintptr_t

from mcf.errors import DTypeError, InvalidArgumentError

from mcf._core._buffers cimport check_out

cdef extern from "fpconv.h" nogil:
    ctypedef enum mcf_fpconv_op:
        MCF_BF16_TO_F32
        MCF_F32_TO_BF16
        MCF_F16_TO_F32
        MCF_F32_TO_F16
    void mcf_convert(mcf_fpconv_op op, const void *src, void *dst, size_t n, int impl)

cdef extern from "cpu.h" nogil:
    int mcf_cpu_best()
    int mcf_cpu_supports(int impl)


IMPLS = ("scalar", "avx2", "avx512", "neon")  # the variant indexes of csrc/cpu.h, by name


def supported_impls():
    """The variants this CPU can run, by name (scalar first; x86: avx2, avx512; aarch64: neon)."""
    return [n for i, n in enumerate(IMPLS) if mcf_cpu_supports(i)]


def env_impl():
    """$MCF_FORCE_IMPL, lower-cased, or None when unset or empty."""
    v = os.environ.get("MCF_FORCE_IMPL", "").strip().lower()
    return v or None


cdef int resolve_impl(object impl) except -1:
    """The variant index to run: ``impl`` if given, else ``$MCF_FORCE_IMPL``, else the best the CPU has.
    Asking for a variant this CPU cannot run is an error, never a silent fallback.  The one place this
    rule lives: every compiled module (and mcf._core._kernels.resolve_impl) cimports it."""
    name = impl if impl is not None else env_impl()
    if name is None:
        return mcf_cpu_best()
    name = str(name).lower()
    where = "impl" if impl is not None else "MCF_FORCE_IMPL"  # the message says which setting was wrong
    if name not in IMPLS:
        raise InvalidArgumentError(f"{where}={name!r}: unknown kernel variant (expected one of {', '.join(IMPLS)})")
    i = IMPLS.index(name)
    if not mcf_cpu_supports(i):
        raise InvalidArgumentError(f"{where}={name!r}: this CPU cannot run that kernel variant (it supports "
                                   f"{', '.join(supported_impls())})")
    return i


# -- the C-level surface (mcf/_core/_fpconv.pxd): unchecked, GIL-free ----------------------------------------
cdef void bf16_to_f32_n(const uint16_t* src, float* dst, size_t n, int impl) noexcept nogil:
    mcf_convert(MCF_BF16_TO_F32, src, dst, n, impl)


cdef void f32_to_bf16_n(const float* src, uint16_t* dst, size_t n, int impl) noexcept nogil:
    mcf_convert(MCF_F32_TO_BF16, src, dst, n, impl)


cdef void f16_to_f32_n(const uint16_t* src, float* dst, size_t n, int impl) noexcept nogil:
    mcf_convert(MCF_F16_TO_F32, src, dst, n, impl)


cdef void f32_to_f16_n(const float* src, uint16_t* dst, size_t n, int impl) noexcept nogil:
    mcf_convert(MCF_F32_TO_F16, src, dst, n, impl)


cdef _contig(src, dtype=None):
    # np.ascontiguousarray would turn a 0-d array into a 1-d one
    # aligned too: C reads it as float/uint16_t (safetensors data may start at any byte offset)
    a = np.asarray(src, dtype=dtype)
    return a if a.flags.c_contiguous and a.flags.aligned else a.copy(order="C")


cdef _prep_out(src, out, dtype):
    if out is None:
        return np.empty(src.shape, dtype=dtype)
    if not isinstance(out, np.ndarray) or out.dtype != np.dtype(dtype):
        raise DTypeError(f"out must be a numpy array of dtype {np.dtype(dtype).name}")
    check_out(out, "out")
    if out.size != src.size:
        raise InvalidArgumentError(f"out has {out.size} elements, expected {src.size}")
    return out


cdef _run(mcf_fpconv_op op, a, res, impl):
    """Checked shapes in, one GIL-free C loop: a and res are C-contiguous with the same size."""
    cdef size_t n = a.size
    cdef int im = resolve_impl(impl)
    cdef uintptr_t sp = a.ctypes.data, dp = res.ctypes.data
    if a.size != res.size:  # _prep_out guarantees it; C never trusts an unchecked length
        raise InvalidArgumentError("size mismatch")
    if n:
        with nogil:
            mcf_convert(op, <const void*>sp, <void*>dp, n, im)
    return res


def _halves(src, what):
    a = _contig(src)
    if a.dtype.itemsize != 2 or (a.dtype.kind not in "uf" and a.dtype.name != "bfloat16"):
        raise DTypeError(f"expected {what}, got {a.dtype}")
    if a.dtype.byteorder == ">":  # the bits of a big-endian half are byte-swapped: read them as values
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.view(np.uint16)


def bf16_to_f32(src, out=None, impl=None):
    """Widen bfloat16 bit patterns (uint16, or ml_dtypes.bfloat16) to float32.  Exact."""
    a = _halves(src, "uint16 bfloat16 bits")
    return _run(MCF_BF16_TO_F32, a, _prep_out(a, out, np.float32), impl)


def f32_to_bf16(src, out=None, impl=None):
    """Narrow float32 to bfloat16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    return _run(MCF_F32_TO_BF16, a, _prep_out(a, out, np.uint16), impl)


def f16_to_f32(src, out=None, impl=None):
    """Widen float16 (or its uint16 bit patterns) to float32.  Exact, subnormals kept."""
    a = _halves(src, "float16 or uint16")
    return _run(MCF_F16_TO_F32, a, _prep_out(a, out, np.float32), impl)


def f32_to_f16(src, out=None, impl=None):
    """Narrow float32 to float16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    return _run(MCF_F32_TO_F16, a, _prep_out(a, out, np.uint16), impl)


def f64_to_f16(src):
    """Narrow float64 to float16 bit patterns (uint16), rounded once to nearest even from the exact
    value.  Going through float32 would round twice: 1 + 2**-11 + 2**-40 becomes 1.0 instead of the
    next float16 up.  numpy's float64 -> float16 cast rounds once."""
    a = np.asarray(src, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond the float16 range is infinity, as a cast should
        return a.astype(np.float16).view(np.uint16)


def f64_to_bf16(src, impl=None):
    """Narrow float64 to bfloat16 bit patterns (uint16), rounded once to nearest even.

    float64 -> float32 is rounded to odd (truncate, then set the last bit when anything was cut
    off), which keeps the information a second rounding needs: float32 has 16 more significand bits
    than bfloat16, so the float32 -> bfloat16 step then rounds exactly as a direct conversion would."""
    a = np.ascontiguousarray(src, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        t = a.astype(np.float32)                     # nearest even
        back = t.astype(np.float64)
        inexact = (back != a) & ~np.isnan(a)
        away = inexact & (np.abs(back) > np.abs(a))  # rounded away from zero (or to infinity)
    bits = t.view(np.uint32)
    bits -= away.astype(np.uint32)                   # one step toward zero: the truncation
    bits |= inexact.astype(np.uint32)                # odd when inexact
    return f32_to_bf16(t, impl=impl)
