# cython: language_level=3
"""Decoding KV chunks straight into caller-owned memory (see csrc/lz4block.c for why)."""

from libc.stdint cimport int64_t, uint8_t

from mcf.errors import FormatError


cdef extern from "lz4block.h" nogil:
    int64_t mcf_lz4_decompress_into(const uint8_t *src, size_t src_len, uint8_t *dst, size_t dst_len)
    int MCF_LZ4_MALFORMED
    int MCF_LZ4_TOO_LONG
    int MCF_LZ4_TOO_SHORT


def lz4_block_decompress_into(const uint8_t[::1] src not None, uint8_t[::1] dst not None):
    """Decode the LZ4 block ``src`` into all of ``dst`` (writable, contiguous bytes) without the GIL.
    Raises FormatError when the block is malformed or does not decode to exactly ``len(dst)`` bytes."""
    cdef int64_t r
    cdef size_t n = src.shape[0], m = dst.shape[0]
    cdef const uint8_t *sp = &src[0] if n else NULL
    cdef uint8_t *dp = &dst[0] if m else NULL
    cdef uint8_t empty = 0
    if sp == NULL:
        sp = &empty
    if dp == NULL:
        dp = &empty
    with nogil:
        r = mcf_lz4_decompress_into(sp, n, dp, m)
    if r == MCF_LZ4_MALFORMED:
        raise FormatError("malformed lz4 block")
    if r == MCF_LZ4_TOO_LONG:
        raise FormatError(f"lz4 block decodes to more than the expected {m} bytes")
    if r == MCF_LZ4_TOO_SHORT:
        raise FormatError(f"lz4 block decodes to fewer than the expected {m} bytes")
    return r
