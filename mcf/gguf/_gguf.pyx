"""Compiled ggml block decoding for :mod:`mcf.gguf`: thin, validating wrappers over csrc/gguf_dequant.c.

Every size is checked here, with Python integers, before the C code runs with the GIL released.  The
variant (scalar / avx2 / avx512 / neon) is chosen as in :mod:`mcf._core._kernels` (CPU, ``MCF_FORCE_IMPL``, or
``impl=``).
"""

import numpy as np

from libc.stdint cimport uint8_t, uint16_t, uintptr_t

from mcf._core._buffers cimport check_out, flat_bytes
from mcf._core._kernel_args cimport out_kind, run_split, thread_count
from mcf._core._fpconv cimport resolve_impl
from mcf._core._fpconv import IMPLS
from mcf.errors import DTypeError, InvalidArgumentError

cdef extern from "gguf_dequant.h" nogil:
    size_t mcf_gguf_block_size(int type)
    size_t mcf_gguf_type_size(int type)
    int mcf_gguf_has_variant(int type, int impl)
    const void* mcf_gguf_table(const char* name, size_t* nbytes)
    int mcf_gguf_dequant(int type, const uint8_t* src, size_t nblocks, void* out, int out_kind, int impl)
    size_t mcf_gguf_scales(int type, const uint8_t* src, size_t nblocks, uint16_t* scales)
    void mcf_gguf_codes(int type, const uint8_t* src, size_t nblocks, uint8_t* codes)

def block_info(int gtype):
    """(values per block, bytes per block) of a ggml type mcf decodes, else (0, 0)."""
    return mcf_gguf_block_size(gtype), mcf_gguf_type_size(gtype)


def own_variants(int gtype):
    """The kernel variants with their own code for ggml type ``gtype`` (``("scalar", "avx2", "avx512")``
    at most on x86-64, ``("scalar", "neon")`` on aarch64); a variant left out runs the next lower one's
    code (NEON's next lower one is scalar)."""
    return tuple(n for k, n in enumerate(IMPLS) if mcf_gguf_has_variant(gtype, k))


# ggml types with a vector variant; the others run the scalar code whatever impl says
VECTOR_TYPES = tuple(c for c in range(64) if len(own_variants(c)) > 1)


def table(str name):
    """The bytes of a compiled-in IQ codebook (``"iq2xxs_grid"``, ``"ksigns_iq2xs"``, ...), for the tests
    that compare them with gguf-py's."""
    cdef size_t n = 0
    b = name.encode("ascii")
    cdef const void* p = mcf_gguf_table(b, &n)
    if p == NULL:
        raise InvalidArgumentError(f"no compiled table named {name!r}")
    return (<const char*>p)[:n]


cdef struct _Blocks:          # one dequantize_blocks call, for the split (_kernel_args.run_split)
    int gtype
    const uint8_t* src
    char* out
    size_t type_size, out_block_bytes
    int kind, impl


cdef void _dequant_blocks(const void* job, size_t a, size_t b) noexcept nogil:
    cdef const _Blocks* j = <const _Blocks*>job
    mcf_gguf_dequant(j.gtype, j.src + a * j.type_size, b - a, j.out + a * j.out_block_bytes, j.kind, j.impl)


cdef enum:
    MIN_BLOCKS_PER_THREAD = 16   # a thread decodes 16 blocks at least (512+ values): fewer are not worth one


def dequantize_blocks(src, int gtype, nblocks, out, *, threads=1, impl=None):
    """Decode ``nblocks`` blocks of ggml type ``gtype`` from the bytes ``src`` into the flat, writeable,
    C-contiguous array ``out`` (float32, float16, or bfloat16 / uint16 bits)."""
    cdef size_t bs = mcf_gguf_block_size(gtype), ts = mcf_gguf_type_size(gtype)
    if bs == 0:
        raise DTypeError(f"ggml type {gtype} cannot be decoded")
    nb = int(nblocks)
    if nb < 0:
        raise InvalidArgumentError("negative block count")
    cdef Py_ssize_t nthreads = min(thread_count(threads), nb // MIN_BLOCKS_PER_THREAD)
    a = flat_bytes(src)
    if a.size < nb * ts:
        raise InvalidArgumentError(f"source has {a.size} bytes, {nb} blocks need {nb * ts}")
    check_out(out, "out")
    if out.size < nb * bs:
        raise InvalidArgumentError(f"out holds {out.size} values, {nb} blocks give {nb * bs}")
    cdef _Blocks job
    job.kind = out_kind(out.dtype)
    job.impl = resolve_impl(impl)
    if nb == 0:
        return out
    job.gtype = gtype
    job.src = <const uint8_t*><uintptr_t>a.ctypes.data
    job.out = <char*><uintptr_t>out.ctypes.data
    job.type_size = ts
    job.out_block_bytes = bs * out.dtype.itemsize
    run_split(_dequant_blocks, &job, 0, nb, nthreads)
    return out


def relayout_scales(src, int gtype, nblocks, scales):
    """Copy the f16 scales of ``nblocks`` Q8_0 (8) / Q4_0 (2) blocks into the uint16 array ``scales``;
    returns how many are subnormal, infinite or NaN."""
    if gtype not in (8, 2):
        raise DTypeError("only Q8_0 and Q4_0 can be re-laid out")
    cdef size_t ts = mcf_gguf_type_size(gtype)
    nb = int(nblocks)
    a = flat_bytes(src)
    if nb < 0 or a.size < nb * ts:
        raise InvalidArgumentError(f"source has {a.size} bytes, {nb} blocks need {nb * ts}")
    check_out(scales, "scales")
    if scales.dtype != np.uint16 or scales.size < nb:
        raise InvalidArgumentError("scales must be a writeable contiguous uint16 array of nblocks items")
    cdef uintptr_t sp = a.ctypes.data, op = scales.ctypes.data
    cdef size_t n = nb, bad = 0
    if n:
        with nogil:
            bad = mcf_gguf_scales(gtype, <const uint8_t*>sp, n, <uint16_t*>op)
    return bad


def relayout_codes(src, int gtype, nblocks, codes):
    """Write the codes of ``nblocks`` Q8_0 / Q4_0 blocks as MCF q8 / q4 packs them into the uint8
    array ``codes`` (32 / 16 bytes per block)."""
    if gtype not in (8, 2):
        raise DTypeError("only Q8_0 and Q4_0 can be re-laid out")
    cdef size_t ts = mcf_gguf_type_size(gtype)
    cdef size_t cb = 32 if gtype == 8 else 16
    nb = int(nblocks)
    a = flat_bytes(src)
    if nb < 0 or a.size < nb * ts:
        raise InvalidArgumentError(f"source has {a.size} bytes, {nb} blocks need {nb * ts}")
    check_out(codes, "codes")
    if codes.dtype != np.uint8 or codes.size < nb * cb:
        raise InvalidArgumentError(f"codes must be a writeable contiguous uint8 array of {nb * cb} bytes")
    cdef uintptr_t sp = a.ctypes.data, op = codes.ctypes.data
    cdef size_t n = nb
    if n:
        with nogil:
            mcf_gguf_codes(gtype, <const uint8_t*>sp, n, <uint8_t*>op)


def parse_strings(buf, Py_ssize_t start, Py_ssize_t count, unsigned long long max_len, list out):
    """Parse up to ``count`` GGUF strings (u64 length + bytes) from ``buf`` at ``start`` into ``out``
    (``str``, or ``bytes`` when not UTF-8), stopping at the first one that does not lie whole inside
    ``buf``.  Returns (parsed, position after them, status): status 1 means the next length exceeds
    ``max_len``; the caller checks a truncated string against the file, refills, and calls again."""
    cdef const uint8_t[::1] b = buf
    cdef Py_ssize_t pos = start, end = b.shape[0], k = 0
    cdef unsigned long long n
    cdef const uint8_t* p
    if start < 0 or start > end:
        raise InvalidArgumentError("start outside the buffer")
    while k < count:
        if end - pos < 8:
            break
        p = &b[pos]
        n = (<unsigned long long>p[0] | (<unsigned long long>p[1] << 8) | (<unsigned long long>p[2] << 16) |
             (<unsigned long long>p[3] << 24) | (<unsigned long long>p[4] << 32) | (<unsigned long long>p[5] << 40) |
             (<unsigned long long>p[6] << 48) | (<unsigned long long>p[7] << 56))
        if n > max_len:
            return k, pos, 1
        if n > <unsigned long long>(end - pos - 8):
            break
        if n == 0:
            out.append("")
        else:
            raw = (<const char*>(p + 8))[:n]
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(raw)
        pos += 8 + <Py_ssize_t>n
        k += 1
    return k, pos, 0
