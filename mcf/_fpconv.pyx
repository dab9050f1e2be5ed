"""Compiled float conversions: bfloat16/float16 to and from float32, round to nearest even.

Thin wrappers: they check shapes and dtypes, then release the GIL for the C loops in csrc/fpconv.c.
"""
import numpy as np

from libc.stdint cimport uint16_t

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


def bf16_to_f32(src, out=None, impl=None):
    """Widen bfloat16 bit patterns (uint16, or ml_dtypes.bfloat16) to float32.  Exact."""
    a = _contig(src)
    if a.dtype.itemsize != 2 or a.dtype.kind not in "uV" and a.dtype.name != "bfloat16":
        raise TypeError(f"expected uint16 bfloat16 bits, got {a.dtype}")
    a = a.view(np.uint16)
    res = _prep_out(a, out, np.float32)
    cdef const uint16_t[::1] s = a.reshape(-1)
    cdef float[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    cdef int im = _impl(impl)
    if n:
        with nogil:
            mcf_convert(0, &s[0], &d[0], n, im)
    return res


def f32_to_bf16(src, out=None, impl=None):
    """Narrow float32 to bfloat16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    res = _prep_out(a, out, np.uint16)
    cdef const float[::1] s = a.reshape(-1)
    cdef uint16_t[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    cdef int im = _impl(impl)
    if n:
        with nogil:
            mcf_convert(1, &s[0], &d[0], n, im)
    return res


def f16_to_f32(src, out=None, impl=None):
    """Widen float16 (or its uint16 bit patterns) to float32.  Exact, subnormals kept."""
    a = _contig(src)
    if a.dtype.itemsize != 2:
        raise TypeError(f"expected float16 or uint16, got {a.dtype}")
    a = a.view(np.uint16)
    res = _prep_out(a, out, np.float32)
    cdef const uint16_t[::1] s = a.reshape(-1)
    cdef float[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    cdef int im = _impl(impl)
    if n:
        with nogil:
            mcf_convert(2, &s[0], &d[0], n, im)
    return res


def f32_to_f16(src, out=None, impl=None):
    """Narrow float32 to float16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    res = _prep_out(a, out, np.uint16)
    cdef const float[::1] s = a.reshape(-1)
    cdef uint16_t[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    cdef int im = _impl(impl)
    if n:
        with nogil:
            mcf_convert(3, &s[0], &d[0], n, im)
    return res
