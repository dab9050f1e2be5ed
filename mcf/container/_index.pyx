"""Compiled scan of a TensorIndex entry table: validation and TensorInfo construction in one pass.

Opening a checkpoint must cost microseconds per tensor, not a Python loop's worth.  The Python caller
(mcf/container/tensor_index.py) has already checked that the entry, dims and string tables lie inside the
section; this scan checks each entry against them with overflow-checked 64-bit arithmetic and reports
the first problem through ``ferr`` so the message carries the file, field and offset.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp

from mcf.errors import InvalidArgumentError

DEF ENTRY_SIZE = 40

cdef extern from *:
    """
    static inline int mcf_mul_u64(unsigned long long a, unsigned long long b, unsigned long long *r) {
        return __builtin_mul_overflow(a, b, r);
    }
    """
    int mcf_mul_u64(unsigned long long a, unsigned long long b, unsigned long long *r) nogil


cdef inline uint32_t ld32(const uint8_t* p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t ld64(const uint8_t* p) noexcept nogil:
    return <uint64_t>ld32(p) | (<uint64_t>ld32(p + 4) << 32)


def scan_entries(const uint8_t[::1] sec, uint64_t entries_off, uint32_t count, uint64_t dims_off,
                 uint32_t dims_count, uint64_t strings_off, uint64_t strings_size,
                 bint check_range, uint64_t d_lo, uint64_t d_hi, bint aligned64, uint32_t max_rank,
                 list dtinfos, list itemsizes, dict extensions, object info_cls, object quant_size, object ferr):
    """Return ``(infos, names_b, is_sorted)`` for the entry table, or raise ``ferr(...)``.

    ``dtinfos[code]``/``itemsizes[code]`` (256 entries) give the DTypeInfo and the item size (-1
    unknown code, 0 quantized, -2 four bits); ``extensions`` maps the codes from 256 on to the same
    ``(DTypeInfo, item size)`` pair; ``quant_size(code, shape, i, name, at)`` returns a quantized tensor's
    exact size (and raises ``ferr(...)`` for a shape its dtype cannot have); ``ferr(kind, reason, field,
    at, expected, got)`` builds the exception to raise.
    """
    cdef Py_ssize_t n = sec.shape[0]
    # The caller checked the tables; check again here, since this code trusts no length it did not see.
    if (entries_off > <uint64_t>n or <uint64_t>count * ENTRY_SIZE > <uint64_t>n - entries_off
            or dims_off > <uint64_t>n or <uint64_t>dims_count * 8 > <uint64_t>n - dims_off
            or strings_off > <uint64_t>n or strings_size > <uint64_t>n - strings_off):
        raise InvalidArgumentError("scan_entries: tables outside the section")
    cdef const uint8_t* base = &sec[0] if n else NULL
    cdef const uint8_t* p
    cdef const uint8_t* strings = base + strings_off if n else NULL
    cdef const uint8_t* dims = base + dims_off if n else NULL
    cdef uint32_t i, k, name_off, name_len, code, rank, dim_off
    cdef uint32_t prev_off = 0, prev_len = 0
    cdef uint64_t data_off, data_size, at, elems, want, d, isz, nonzero, nbytes_np
    cdef int cmp, isz_code
    cdef bint is_sorted = True, overflow, too_big
    cdef list infos = []
    cdef list names_b = []
    cdef tuple shape
    cdef object v
    for i in range(count):
        at = entries_off + <uint64_t>i * ENTRY_SIZE
        p = base + at
        name_off = ld32(p)
        name_len = ld32(p + 4)
        code = ld32(p + 8)
        rank = ld32(p + 12)
        dim_off = ld32(p + 16)
        data_off = ld64(p + 24)
        data_size = ld64(p + 32)
        if <uint64_t>name_off + name_len > strings_size:
            raise ferr("truncated", "name outside the string blob", f"entry[{i}].name_off", at,
                       f"end <= {strings_size}", <uint64_t>name_off + name_len)
        if name_len == 0:
            raise ferr("format", "empty tensor name", f"entry[{i}].name_len", at + 4, None, None)
        if rank > max_rank:
            raise ferr("format", "rank too large", f"entry[{i}].rank", at + 12, f"<= {max_rank}", rank)
        if <uint64_t>dim_off + rank > dims_count:
            raise ferr("truncated", "shape outside the dims table", f"entry[{i}].dim_off", at + 16,
                       f"dim_off + rank <= {dims_count}", <uint64_t>dim_off + rank)
        raw = PyBytes_FromStringAndSize(<const char*>(strings + name_off), name_len)
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ferr("format", "tensor name is not valid UTF-8", f"entry[{i}].name", at, None,
                       raw[:80]) from None
        if code <= 255:
            dtinfo = dtinfos[code]
            isz_code = <int>itemsizes[code]
        else:
            ext = extensions.get(code)
            dtinfo, isz_code = ext if ext is not None else (None, -1)
        if isz_code == -1:   # never guessed at: its size, and what its bytes mean, are unknown here
            raise ferr("format", f"unknown dtype of tensor {name!r}", f"entry[{i}].dtype", at + 8,
                       "a code of the MCF dtype table", code)
        if i and is_sorted:
            cmp = memcmp(strings + prev_off, strings + name_off, prev_len if prev_len < name_len else name_len)
            if cmp > 0 or (cmp == 0 and prev_len >= name_len):
                is_sorted = False
        prev_off = name_off
        prev_len = name_len
        shape = PyTuple_New(rank)
        elems = 1
        nonzero = 1
        overflow = False
        too_big = False
        for k in range(rank):
            d = ld64(dims + (<uint64_t>dim_off + k) * 8)
            v = d  # a Python int
            Py_INCREF(v)
            PyTuple_SET_ITEM(shape, k, v)
            if mcf_mul_u64(elems, d, &elems):
                overflow = True
            if d and mcf_mul_u64(nonzero, d, &nonzero):
                too_big = True
        isz = <uint64_t>isz_code if isz_code >= 0 else 1   # (-2: four bits, at most one byte each)
        if isz_code == 0:
            if rank != 2 and code <= 255:
                raise ferr("format", f"quantized tensor {name!r} is not rank 2", f"entry[{i}].rank",
                           at + 12, 2, rank)
            if not aligned64:
                raise ferr("format", f"quantized tensor {name!r} in a file without the "
                           "TensorDataAligned64 flag", f"entry[{i}].dtype", at + 8, None, None)
            if data_off % 64:
                raise ferr("format", f"quantized tensor {name!r} data is not 64-byte aligned",
                           f"entry[{i}].data_off", at + 24, "multiple of 64", data_off)
            pywant = quant_size(code, shape, i, name, at)
            if pywant != data_size:
                raise ferr("size", name, f"entry[{i}].data_size", at + 32, (pywant, dtinfo, shape),
                           data_size)
        elif isz_code == -2:   # two values per byte: an even count, as safetensors requires
            if overflow or elems % 2 or elems // 2 != data_size:
                raise ferr("size", name, f"entry[{i}].data_size", at + 32, (None, dtinfo, shape),
                           data_size)
        else:
            if overflow or mcf_mul_u64(elems, isz, &want) or want != data_size:
                raise ferr("size", name, f"entry[{i}].data_size", at + 32, (None, dtinfo, shape),
                           data_size)
        # (after the size check, so only a shape with a zero dim gets here)
        # numpy refuses any array whose non-zero dims times its item size pass 2**63 - 1, even an empty
        # one: reject such a shape here (itemsize 4 for quantized tensors: they decode to float32)
        if too_big or mcf_mul_u64(nonzero, isz if isz_code else 4, &nbytes_np) or nbytes_np > <uint64_t>0x7fffffffffffffff:
            raise ferr("format", f"shape of {name!r} is too large for an array", f"entry[{i}].dim_off",
                       at + 16, "non-zero dims * itemsize < 2**63", shape)
        if check_range and (data_off < d_lo or data_off > d_hi or data_size > d_hi - data_off):
            raise ferr("truncated", f"data of {name!r} lies outside the TensorData section",
                       f"entry[{i}].data_off", at + 24, f"range inside [{d_lo}, {d_hi})",
                       f"[{data_off}, {(<object>data_off) + data_size})")
        infos.append(tuple.__new__(info_cls, (name, dtinfo, shape, data_off, data_size, i)))
        names_b.append(raw)
    return infos, names_b, is_sorted
