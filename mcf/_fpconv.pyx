"""Compiled float conversions: bfloat16/float16 to and from float32, round to nearest even.

Thin wrappers: they check shapes and dtypes, then release the GIL for the C loops in csrc/fpconv.c.
"""
import numpy as np

from libc.stdint cimport uint16_t

cdef extern from "fpconv.h" nogil:
    void mcf_bf16_to_f32(const uint16_t *src, float *dst, size_t n)
    void mcf_f32_to_bf16(const float *src, uint16_t *dst, size_t n)
    void mcf_f16_to_f32(const uint16_t *src, float *dst, size_t n)
    void mcf_f32_to_f16(const float *src, uint16_t *dst, size_t n)


cdef _contig(src, dtype=None):
    # np.ascontiguousarray would turn a 0-d array into a 1-d one
    a = np.asarray(src, dtype=dtype)
    return a if a.flags.c_contiguous else a.copy(order="C")


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


def bf16_to_f32(src, out=None):
    """Widen bfloat16 bit patterns (uint16, or ml_dtypes.bfloat16) to float32.  Exact."""
    a = _contig(src)
    if a.dtype.itemsize != 2 or a.dtype.kind not in "uV" and a.dtype.name != "bfloat16":
        raise TypeError(f"expected uint16 bfloat16 bits, got {a.dtype}")
    a = a.view(np.uint16)
    res = _prep_out(a, out, np.float32)
    cdef const uint16_t[::1] s = a.reshape(-1)
    cdef float[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    if n:
        with nogil:
            mcf_bf16_to_f32(&s[0], &d[0], n)
    return res


def f32_to_bf16(src, out=None):
    """Narrow float32 to bfloat16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    res = _prep_out(a, out, np.uint16)
    cdef const float[::1] s = a.reshape(-1)
    cdef uint16_t[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    if n:
        with nogil:
            mcf_f32_to_bf16(&s[0], &d[0], n)
    return res


def f16_to_f32(src, out=None):
    """Widen float16 (or its uint16 bit patterns) to float32.  Exact, subnormals kept."""
    a = _contig(src)
    if a.dtype.itemsize != 2:
        raise TypeError(f"expected float16 or uint16, got {a.dtype}")
    a = a.view(np.uint16)
    res = _prep_out(a, out, np.float32)
    cdef const uint16_t[::1] s = a.reshape(-1)
    cdef float[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    if n:
        with nogil:
            mcf_f16_to_f32(&s[0], &d[0], n)
    return res


def f32_to_f16(src, out=None):
    """Narrow float32 to float16 bit patterns (uint16), round to nearest even."""
    a = _contig(src, np.float32)
    res = _prep_out(a, out, np.uint16)
    cdef const float[::1] s = a.reshape(-1)
    cdef uint16_t[::1] d = res.reshape(-1)
    cdef size_t n = a.size
    if n:
        with nogil:
            mcf_f32_to_f16(&s[0], &d[0], n)
    return res
