"""The TensorIndex section (0x0003): names, dtypes, shapes and data ranges of every tensor.

    header (48 bytes): u32 version=1 | u32 flags (bit0 sorted by name, bit1 UTF-8 names)
                       | u32 tensor_count | u32 dims_count | u64 entries_off | u64 dims_off
                       | u64 strings_off | u64 strings_size             (offsets relative to section)
    entries[tensor_count], 40 bytes each:
        u32 name_off | u32 name_len | u32 dtype | u32 rank | u32 dim_off | u32 pad
        | u64 data_off (absolute file offset) | u64 data_size
    u64 dims[dims_count]            (shape[0] = rows, row-major)
    name blob (no separators)

Parsing is vectorized with numpy over the entry table; per-tensor Python work is limited to building
the name and shape, so opening a checkpoint of thousands of tensors stays in the millisecond range.
"""

from __future__ import annotations

import bisect
import functools
import math
import struct
from typing import Iterator, NamedTuple

import numpy as np

from mcf._core.dtypes import DType, DTypeInfo, dtype_info, is_known, plain_nbytes
from mcf.errors import FormatError, InvalidArgumentError, TensorNotFoundError, TruncatedError, UnsupportedVersionError
from mcf.container._index import scan_entries
from mcf.container.layout import MAX_RANK, QuantLayout, quant_layout

__all__ = ["TensorInfo", "TensorIndex", "encode_tensor_index", "HEADER", "ENTRY_DTYPE"]

HEADER = struct.Struct("<IIIIQQQQ")
assert HEADER.size == 48
VERSION = 1
FLAG_SORTED = 1 << 0
FLAG_UTF8 = 1 << 1

ENTRY_DTYPE = np.dtype([
    ("name_off", "<u4"), ("name_len", "<u4"), ("dtype", "<u4"), ("rank", "<u4"),
    ("dim_off", "<u4"), ("pad", "<u4"), ("data_off", "<u8"), ("data_size", "<u8"),
])
assert ENTRY_DTYPE.itemsize == 40


class TensorInfo(NamedTuple):
    """What the index says about one tensor."""

    name: str
    dtype: DTypeInfo
    shape: tuple
    offset: int      # absolute file offset of the data
    nbytes: int      # size of the data
    index: int       # position in the sorted entry table (QuantInfo refers to it)

    @property
    def quantized(self) -> bool:
        return self.dtype.quantized

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _size_code(info) -> int:
    """What the compiled scan needs of a dtype: bytes per element, 0 for quantized payloads, -2 for four
    bits (F4), -1 for an unknown code."""
    if info is None:
        return -1
    return -2 if info.family == "float4" else info.itemsize


_DTINFOS = [dtype_info(c) if is_known(c) else None for c in range(256)]
_ITEMSIZES = [_size_code(t) for t in _DTINFOS]
#: the dtypes with codes from 256 on (mcf's extensions): code -> (DTypeInfo, size code)
_EXTENSIONS = {int(c): (dtype_info(c), _size_code(dtype_info(c))) for c in DType if c > 255}


@functools.lru_cache(maxsize=4096)
def cached_layout(code: int, shape: tuple, domain: int) -> QuantLayout:
    return quant_layout(code, shape, domain=domain)


class TensorIndex:
    """Parsed, validated view of a TensorIndex payload.  Behaves like a read-only mapping from
    name to :class:`TensorInfo`; lookups are binary searches over the sorted names."""

    def __init__(self, infos: list, names_b: list, flags: int, *, disk_order: list | None = None):
        self._infos = infos
        self._names_b = names_b
        self._disk = disk_order if disk_order is not None else infos
        self.flags = flags

    # mapping protocol
    def __len__(self) -> int:
        return len(self._infos)

    def __iter__(self) -> Iterator[str]:
        return (t.name for t in self._infos)

    def __contains__(self, name) -> bool:
        return self.find(name) >= 0

    def __getitem__(self, name) -> TensorInfo:
        i = self.find(name)
        if i < 0:
            raise TensorNotFoundError(f"no tensor named {name!r}")
        return self._infos[i]

    def find(self, name) -> int:
        """Position of ``name`` in the sorted table, or -1."""
        key = name.encode("utf-8") if isinstance(name, str) else bytes(name)
        names = self._names_b
        i = bisect.bisect_left(names, key)
        if i < len(names) and names[i] == key:
            return i
        return -1

    def at(self, i: int) -> TensorInfo:
        """The i-th tensor in name order."""
        return self._infos[i]

    def position(self, i: int) -> TensorInfo:
        """The tensor at position ``i`` of the on-disk entry table (what QuantInfo refers to)."""
        return self._disk[i]

    def keys(self):
        return [t.name for t in self._infos]

    def values(self):
        return list(self._infos)

    def items(self):
        return [(t.name, t) for t in self._infos]

    @classmethod
    def parse(cls, data, *, path=None, base_offset: int = 0, data_range=None, domains=None,
              aligned64: bool = True) -> "TensorIndex":
        """Validate and parse a TensorIndex payload.

        ``data_range`` is the (offset, size) of the TensorData section, which every tensor must lie in;
        ``domains`` maps entry position -> quant domain (from QuantInfo) for int8/int4 sizes.
        """
        buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        n = len(buf)

        def ferr(cls_, reason, field, off, **kw):
            return cls_(reason, path=path, field=f"TensorIndex.{field}", offset=base_offset + off, **kw)

        if n < HEADER.size:
            raise ferr(TruncatedError, "section too small", "header", 0,
                       expected=f">= {HEADER.size} bytes", got=f"{n} bytes")
        (version, flags, count, dims_count, entries_off, dims_off, strings_off,
         strings_size) = HEADER.unpack_from(buf, 0)
        if version != VERSION:
            raise ferr(UnsupportedVersionError, "unsupported version", "version", 0,
                       expected=VERSION, got=version)
        if count == 0:
            raise ferr(FormatError, "tensor_count is zero", "tensor_count", 8, expected="> 0", got=0)
        for field, off, length, at in (("entries_off", entries_off, count * ENTRY_DTYPE.itemsize, 16),
                                       ("dims_off", dims_off, dims_count * 8, 24),
                                       ("strings_off", strings_off, strings_size, 32)):
            if off > n or length > n - off:
                raise ferr(TruncatedError, "table runs past the end of the section", field, at,
                           expected=f"{length} bytes at {off} within {n}", got=off)

        domains = domains or {}

        def quant_size(code, shape, i, name, at):
            info = dtype_info(code)
            # only int8/int4 sizes depend on the domain; QuantInfo checks the others' domain
            domain = domains.get(i, 0) if info.family == "raw" else 0
            try:
                return cached_layout(code, shape, domain).nbytes
            except InvalidArgumentError as exc:   # an extension dtype's shape rules (rank, block multiple)
                raise ferr(FormatError, f"tensor {name!r}: {exc}", f"entry[{i}].dim_off", at + 16,
                           expected=f"a shape {info.name} can have", got=list(shape)) from None

        def scan_error(kind, reason, field, at, expected, got):
            if kind == "size":
                want, info, shape = expected
                if want is None:
                    want = plain_nbytes(info, math.prod(shape))
                    if want is None:
                        want = "an even number of values"
                hint = ""
                if info.family == "raw":
                    hint = " (the Go tool writes int8/int4 payloads without the spec's scale region)"
                return ferr(FormatError, f"data_size of {reason!r} does not match its dtype and shape" + hint,
                            field, at, expected=f"{want} ({info.name} {list(shape)})", got=got)
            cls_ = TruncatedError if kind == "truncated" else FormatError
            return ferr(cls_, reason, field, at, expected=expected, got=got)

        d_lo, d_size = data_range if data_range is not None else (0, 0)
        infos, names_b, in_order = scan_entries(
            buf if isinstance(buf, memoryview) else memoryview(buf), entries_off, count, dims_off,
            dims_count, strings_off, strings_size, data_range is not None, d_lo, d_lo + d_size,
            aligned64, MAX_RANK, _DTINFOS, _ITEMSIZES, _EXTENSIONS, TensorInfo, quant_size, scan_error)

        order = None
        if not in_order:
            i = next(i for i in range(1, count) if names_b[i - 1] >= names_b[i])
            dup = len(set(names_b)) != len(names_b)
            if (flags & FLAG_SORTED) or dup:
                if dup and not flags & FLAG_SORTED:
                    seen = set()
                    i = next(i for i, nb in enumerate(names_b) if nb in seen or seen.add(nb))
                dup_here = names_b[i] in names_b[:i]
                raise ferr(FormatError, "duplicate tensor names" if dup_here else
                           "names not sorted although the sorted flag is set",
                           f"entry[{i}].name", entries_off + i * 40,
                           expected="strictly increasing names", got=names_b[i][:80])
            order = sorted(range(count), key=names_b.__getitem__)
        disk = infos
        if order is not None:
            infos = [infos[i] for i in order]
            names_b = [names_b[i] for i in order]
        return cls(infos, names_b, flags, disk_order=disk)


def encode_tensor_index(records) -> bytes:
    """Encode ``records`` (objects with name, dtype code, shape, offset, nbytes) as the Go reference
    does: sorted by name bytes, dims and names appended in entry order, flags = sorted | UTF-8."""
    recs = sorted(records, key=lambda r: r.name.encode("utf-8"))
    if not recs:
        raise InvalidArgumentError("a tensor index needs at least one tensor")
    dims: list[int] = []
    blob = bytearray()
    entries = np.zeros(len(recs), dtype=ENTRY_DTYPE)
    prev = None
    for i, r in enumerate(recs):
        nb = r.name.encode("utf-8")
        if not nb:
            raise InvalidArgumentError("tensor names must be non-empty")
        if nb == prev:
            raise InvalidArgumentError(f"duplicate tensor name {r.name!r}")
        prev = nb
        entries[i] = (len(blob), len(nb), int(r.dtype), len(r.shape), len(dims), 0, r.offset, r.nbytes)
        blob += nb
        dims.extend(int(d) for d in r.shape)
    entries_off = HEADER.size
    dims_off = entries_off + entries.nbytes
    strings_off = dims_off + 8 * len(dims)
    hdr = HEADER.pack(VERSION, FLAG_SORTED | FLAG_UTF8, len(recs), len(dims), entries_off, dims_off,
                      strings_off, len(blob))
    return hdr + entries.tobytes() + np.asarray(dims, dtype="<u8").tobytes() + bytes(blob)
