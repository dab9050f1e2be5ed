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

from mcf.dtypes import DTypeInfo, dtype_info, is_known
from mcf.errors import FormatError, InvalidArgumentError, TensorNotFoundError, TruncatedError, UnsupportedVersionError
from mcf.layout import MAX_RANK, QuantLayout, quant_layout

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


@functools.lru_cache(maxsize=4096)
def _cached_layout(code: int, shape: tuple, domain: int) -> QuantLayout:
    return quant_layout(code, shape, domain)


class TensorIndex:
    """Parsed, validated view of a TensorIndex payload.  Behaves like a read-only mapping from
    name to :class:`TensorInfo`; lookups are binary searches over the sorted names."""

    def __init__(self, infos: list, names_b: list, flags: int, disk_order: list | None = None):
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

        e = np.frombuffer(buf, dtype=ENTRY_DTYPE, count=count, offset=entries_off)
        name_off = e["name_off"].astype(np.uint64)
        name_len = e["name_len"].astype(np.uint64)
        rank = e["rank"]
        dim_off = e["dim_off"].astype(np.uint64)
        codes = e["dtype"]

        bad = name_off + name_len > np.uint64(strings_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ferr(TruncatedError, "name outside the string blob", f"entry[{i}].name_off",
                       entries_off + i * 40, expected=f"end <= {strings_size}",
                       got=int(name_off[i] + name_len[i]))
        bad = name_len == 0
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ferr(FormatError, "empty tensor name", f"entry[{i}].name_len", entries_off + i * 40 + 4)
        bad = rank > MAX_RANK
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ferr(FormatError, "rank too large", f"entry[{i}].rank", entries_off + i * 40 + 12,
                       expected=f"<= {MAX_RANK}", got=int(rank[i]))
        bad = dim_off + rank.astype(np.uint64) > np.uint64(dims_count)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ferr(TruncatedError, "shape outside the dims table", f"entry[{i}].dim_off",
                       entries_off + i * 40 + 16, expected=f"dim_off + rank <= {dims_count}",
                       got=int(dim_off[i]) + int(rank[i]))

        blob = bytes(buf[strings_off:strings_off + strings_size])
        dims = np.frombuffer(buf, dtype="<u8", count=dims_count, offset=dims_off).tolist()
        no_l = name_off.tolist()
        nl_l = name_len.tolist()
        names_b = [blob[o:o + ln] for o, ln in zip(no_l, nl_l)]

        sorted_flag = bool(flags & FLAG_SORTED)
        order = None
        if any(a >= b for a, b in zip(names_b, names_b[1:])):
            if sorted_flag or len(set(names_b)) != len(names_b):
                for i in range(1, len(names_b)):
                    if names_b[i - 1] >= names_b[i]:
                        break
                dup = names_b[i - 1] == names_b[i] if sorted_flag else len(set(names_b)) != len(names_b)
                raise ferr(FormatError, "duplicate tensor names" if dup else
                           "names not sorted although the sorted flag is set",
                           f"entry[{i}].name", entries_off + i * 40,
                           expected="strictly increasing names", got=names_b[i][:80])
            order = sorted(range(len(names_b)), key=names_b.__getitem__)

        d_lo, d_size = data_range if data_range is not None else (0, 0)
        d_hi = d_lo + d_size
        offs = e["data_off"].tolist()
        sizes = e["data_size"].tolist()
        codes_l = codes.tolist()
        ranks_l = rank.tolist()
        doffs_l = dim_off.tolist()
        domains = domains or {}
        infos = []
        for i in range(count):
            code = codes_l[i]
            at = entries_off + i * 40
            if not is_known(code):
                raise ferr(FormatError, "unknown dtype", f"entry[{i}].dtype", at + 8,
                           expected="a code of the MCF dtype table", got=code)
            info = dtype_info(code)
            r = ranks_l[i]
            o = doffs_l[i]
            shape = tuple(dims[o:o + r])
            off = offs[i]
            size = sizes[i]
            raw = names_b[i]
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ferr(FormatError, "tensor name is not valid UTF-8", f"entry[{i}].name", at,
                           got=raw[:80]) from None
            if info.quantized:
                if r != 2:
                    raise ferr(FormatError, f"quantized tensor {name!r} is not rank 2",
                               f"entry[{i}].rank", at + 12, expected=2, got=r)
                if not aligned64:
                    raise ferr(FormatError, f"quantized tensor {name!r} in a file without the "
                               "TensorDataAligned64 flag", f"entry[{i}].dtype", at + 8)
                if off % 64:
                    raise ferr(FormatError, f"quantized tensor {name!r} data is not 64-byte aligned",
                               f"entry[{i}].data_off", at + 24, expected="multiple of 64", got=off)
                # only int8/int4 sizes depend on the domain; QuantInfo checks the others' domain
                domain = domains.get(i, 0) if info.family == "raw" else 0
                want = _cached_layout(code, shape, domain).nbytes
            else:
                want = math.prod(shape) * info.itemsize
            if size != want:
                hint = ""
                if info.family == "raw":
                    hint = " (the Go tool writes int8/int4 payloads without the spec's scale region)"
                raise ferr(FormatError, f"data_size of {name!r} does not match its dtype and shape"
                           + hint, f"entry[{i}].data_size", at + 32,
                           expected=f"{want} ({info.name} {list(shape)})", got=size)
            if data_range is not None and (off < d_lo or off > d_hi or size > d_hi - off):
                raise ferr(TruncatedError, f"data of {name!r} lies outside the TensorData section",
                           f"entry[{i}].data_off", at + 24,
                           expected=f"range inside [{d_lo}, {d_hi})", got=f"[{off}, {off + size})")
            infos.append(TensorInfo(name, info, shape, off, size, i))
        disk = infos
        if order is not None:
            infos = [infos[i] for i in order]
            names_b = [names_b[i] for i in order]
        return cls(infos, names_b, flags, disk)


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
