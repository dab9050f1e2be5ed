"""Compiled float conversions: bfloat16/float16 to and from float32, round to nearest even.

Thin wrappers: they check shapes and dtypes, then release the GIL for the C loops in csrc/fpconv.c.
"""
import numpy as np

from libc.stdint cimport uint16_t, uintptr_t

cdef extern from "fpconv.h" nogil:
    void mcf_convert(int op, const void *src, void *dst, size_t n, int impl)

cdef extern from "cpu.h" nogil:
    int mcf_cpu_best()
    int mcf_cpu_supports(int impl)


_IMPLS = ("scalar", "avx2", "avx512")


cdef int _impl(object impl) except -1:
    # the same rule as mcf._kernels.resolve_impl: keyword, else $MCF_FORCE_IMPL, else the best variant
    import os
    from mcf.errors import InvalidArgumentError

    name = impl if impl is not None else (os.environ.get("MCF_FORCE_IMPL", "").strip().lower() or None)
    if name is None:
        return mcf_cpu_best()
    if name not in _IMPLS:
        raise InvalidArgumentError(f"unknown kernel variant {name!r}; expected one of {_IMPLS}")
    if not mcf_cpu_supports(_IMPLS.index(name)):
        raise InvalidArgumentError(f"kernel variant {name!r} is not supported by this CPU")
    return _IMPLS.index(name)


cdef _contig(src, dtype=None):
    # np.ascontiguousarray would turn a 0-d array into a 1-d one
    # aligned too: C reads it as float/uint16_t (safetensors data may start at any byte offset)
    a = np.asarray(src, dtype=dtype)
    return a if a.flags.c_contiguous and a.flags.aligned else a.copy(order="C")


cdef _prep_out(src, out, dtype):
    if out is None:
        return np.empty(src.shape, dtype=dtype)
    if not isinstance(out, np.ndarray) or out.dtype != np.dtype(dtype):
        raise TypeError(f"out must be a numpy array of dtype {np.dtype(dtype).name}")
    if out.size != src.size:
        raise ValueError(f"out has {out.size} elements, expected {src.size}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writeable")
    return out


cdef _run(int op, a, res, impl):
    """Checked shapes in, one GIL-free C loop: a and res are C-contiguous with the same size."""
    cdef size_t n = a.size
    cdef int im = _impl(impl)
    cdef uintptr_t sp = a.ctypes.data, dp = res.ctypes.data
    if a.size != res.size:  # _prep_out guarantees it; C never trusts an unchecked length
        raise ValueError("size mismatch")
    if n:
        with nogil:
            mcf_convert(op, <const void*>sp, <void*>dp, n, im)
    return res


def _halves(src, what):
    a = _contig(src)
    if a.dtype.itemsize != 2 or (a.dtype.kind not in "uf" and a.dtype.name != "bfloat16"):
        raise TypeError(f"expected {what}, got {a.dtype}")
    if a.dtype.byteorder == ">":  # the bits of a big-endian half are byte-swapped: read them as values
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.view(np.uint16)


def bf16_to_f32(src, out=None, impl=None):
    """Widen bfloat16 bit patterns (uint16, or ml_dtypes.bfloat16) to float32.  Exact."""
    a = _halves(src, "uint16 bfloat16 bits")
    return _run(0, a, _prep_out(a, out, np.float32), impl)


def f32_to_bf16(src, out=None, impl=None):
    """Narrow float32 to bfloat16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    return _run(1, a, _prep_out(a, out, np.uint16), impl)


def f16_to_f32(src, out=None, impl=None):
    """Widen float16 (or its uint16 bit patterns) to float32.  Exact, subnormals kept."""
    a = _halves(src, "float16 or uint16")
    return _run(2, a, _prep_out(a, out, np.float32), impl)


def f32_to_f16(src, out=None, impl=None):
    """Narrow float32 to float16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    return _run(3, a, _prep_out(a, out, np.uint16), impl)


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
