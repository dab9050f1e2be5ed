"""The GGUF reader: validation and fast dequantization (conversion to MCF is :mod:`mcf.conversion.gguf`).

GGUF is the single-file format of llama.cpp / ggml.  Its loaders have had a long run of CVEs (an
integer overflow in a count turned into a heap overflow, a string or array length taken from the file
allocated gigabytes, tiny files hung the parser), so this reader treats every number it reads as
hostile: each count and length is checked against the bytes that remain *before* anything is
allocated or looped over, every tensor must lie aligned inside the data section without overlapping
another, and any failure is an :class:`mcf.MCFError` subclass that names the file, the field and the
offset.  The bytes come through the I/O core (:func:`mcf.io.open_source`), so a path (mapped or read
with ``pread``), an in-memory buffer, a file object or a URL all work the same way.

Only the layout is read here; the bit work (decoding the ggml block types) is in C
(``csrc/gguf_dequant.c`` behind :mod:`mcf.gguf._gguf`).  See docs/gguf.md.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass

import numpy as np

from mcf._core.args import byte_order_problem, row_range
from mcf._core.memory import allocating
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import (
    DTypeError,
    FormatError,
    InvalidArgumentError,
    MCFError,
    TensorNotFoundError,
    TruncatedError,
    UnsupportedVersionError,
)

__all__ = [
    "GGUF_METADATA_SECTION",
    "SUPPORTED_TYPES",
    "GGMLType",
    "GGUFFile",
    "GGUFTensor",
    "ggml_type",
    "open",
]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Limits the reader enforces (beyond "fits in the file", which is checked for everything).
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_KEY_LEN = 1 << 16
MAX_STRING_LEN = 1 << 28        # 256 MiB: a chat template is ~10 KB, a whole tokenizer.json ~10 MB
MAX_ARRAY_LEN = 1 << 31
MAX_ARRAY_DEPTH = 8             # arrays of arrays (gguf allows nesting; nothing real goes past 2)
MAX_ALIGNMENT = 1 << 30
MAX_ELEMENTS = 1 << 59          # product of the non-zero dims (numpy refuses shapes past 2**63 bytes)

# Section type under which convert_gguf keeps the whole GGUF metadata as JSON.  MCF readers skip
# unknown section types (docs/mcf.md), so this needs no change to the MCF format.
GGUF_METADATA_SECTION = 0x0200


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: ``block`` values stored in ``size`` bytes."""

    code: int
    name: str
    block: int
    size: int
    kind: str       # "float", "int" (plain numbers), "quant" (decoded by mcf), "unsupported"

    @property
    def numpy(self):
        return _PLAIN_NUMPY.get(self.name)


# ggml.h's enum ggml_type: code, name, values per block, bytes per block, what mcf does with it.  The
# sizes are also what validates a file's layout, so types mcf cannot decode are listed too (their files
# open, and raw() works).  csrc/gguf_dequant.c holds the same sizes for the decoders; a test checks that
# both agree with each other and with gguf-py's GGML_QUANT_SIZES.
_TYPES = {t.code: t for t in [
    GGMLType(0, "F32", 1, 4, "float"), GGMLType(1, "F16", 1, 2, "float"), GGMLType(2, "Q4_0", 32, 18, "quant"),
    GGMLType(3, "Q4_1", 32, 20, "quant"), GGMLType(6, "Q5_0", 32, 22, "quant"), GGMLType(7, "Q5_1", 32, 24, "quant"),
    GGMLType(8, "Q8_0", 32, 34, "quant"), GGMLType(9, "Q8_1", 32, 40, "unsupported"),
    GGMLType(10, "Q2_K", 256, 84, "quant"), GGMLType(11, "Q3_K", 256, 110, "quant"),
    GGMLType(12, "Q4_K", 256, 144, "quant"), GGMLType(13, "Q5_K", 256, 176, "quant"),
    GGMLType(14, "Q6_K", 256, 210, "quant"), GGMLType(15, "Q8_K", 256, 292, "quant"),
    GGMLType(16, "IQ2_XXS", 256, 66, "quant"), GGMLType(17, "IQ2_XS", 256, 74, "quant"),
    GGMLType(18, "IQ3_XXS", 256, 98, "quant"), GGMLType(19, "IQ1_S", 256, 50, "quant"),
    GGMLType(20, "IQ4_NL", 32, 18, "quant"), GGMLType(21, "IQ3_S", 256, 110, "quant"),
    GGMLType(22, "IQ2_S", 256, 82, "quant"), GGMLType(23, "IQ4_XS", 256, 136, "quant"),
    GGMLType(24, "I8", 1, 1, "int"), GGMLType(25, "I16", 1, 2, "int"), GGMLType(26, "I32", 1, 4, "int"),
    GGMLType(27, "I64", 1, 8, "int"), GGMLType(28, "F64", 1, 8, "float"), GGMLType(29, "IQ1_M", 256, 56, "quant"),
    GGMLType(30, "BF16", 1, 2, "float"), GGMLType(34, "TQ1_0", 256, 54, "quant"),
    GGMLType(35, "TQ2_0", 256, 66, "quant"), GGMLType(39, "MXFP4", 32, 17, "quant"),
    GGMLType(40, "NVFP4", 64, 36, "quant"), GGMLType(41, "Q1_0", 128, 18, "quant"),
    GGMLType(42, "Q2_0", 64, 18, "quant"),
]}
_BY_NAME = {t.name: t for t in _TYPES.values()}
_PLAIN_NUMPY = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8"),
                "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8")}
#: ggml types whose values mcf can decode to float.
SUPPORTED_TYPES = tuple(t.name for t in _TYPES.values() if t.kind in ("float", "quant"))

# GGUF metadata value types: code -> (name, struct format or None)
_VT_UINT8, _VT_INT8, _VT_UINT16, _VT_INT16, _VT_UINT32, _VT_INT32, _VT_FLOAT32, _VT_BOOL, _VT_STRING, \
    _VT_ARRAY, _VT_UINT64, _VT_INT64, _VT_FLOAT64 = range(13)
_SCALAR = {_VT_UINT8: "<B", _VT_INT8: "<b", _VT_UINT16: "<H", _VT_INT16: "<h", _VT_UINT32: "<I",
           _VT_INT32: "<i", _VT_FLOAT32: "<f", _VT_BOOL: "<B", _VT_UINT64: "<Q", _VT_INT64: "<q",
           _VT_FLOAT64: "<d"}
_ARRAY_NUMPY = {_VT_UINT8: "u1", _VT_INT8: "i1", _VT_UINT16: "<u2", _VT_INT16: "<i2", _VT_UINT32: "<u4",
                _VT_INT32: "<i4", _VT_FLOAT32: "<f4", _VT_BOOL: "?", _VT_UINT64: "<u8", _VT_INT64: "<i8",
                _VT_FLOAT64: "<f8"}
VALUE_TYPE_NAMES = {_VT_UINT8: "uint8", _VT_INT8: "int8", _VT_UINT16: "uint16", _VT_INT16: "int16",
                    _VT_UINT32: "uint32", _VT_INT32: "int32", _VT_FLOAT32: "float32", _VT_BOOL: "bool",
                    _VT_STRING: "string", _VT_ARRAY: "array", _VT_UINT64: "uint64", _VT_INT64: "int64",
                    _VT_FLOAT64: "float64"}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def ggml_type(t) -> GGMLType:
    """Look a ggml type up by code or name (``12``, ``"Q4_K"``, ``"q4_k"``)."""
    if isinstance(t, GGMLType):
        return t
    if isinstance(t, str):
        try:
            return _BY_NAME[t.upper()]
        except KeyError:
            raise DTypeError(f"unknown ggml type {t!r}") from None
    try:
        return _TYPES[int(t)]
    except (KeyError, ValueError, TypeError):
        raise DTypeError(f"unknown ggml type code {t!r}; known: {known_types()}") from None


def known_types() -> str:
    """The ggml type codes mcf knows, for error messages: ``0 F32, 1 F16, 2 Q4_0, ...``."""
    return ", ".join(f"{t.code} {t.name}" for t in _TYPES.values())


class _Cursor:
    """Sequential little-endian reads from a Source, every length checked against the bytes left
    before it is used.  Mapped and in-memory sources are parsed in place; the others through a
    1 MiB window (one positional read per window, not one per field)."""

    WINDOW = 1 << 20

    def __init__(self, src, path):
        self.src = src
        self.path = path
        self.size = src.size
        self.pos = 0
        if src.mode in ("mmap", "memory") and self.size:
            self.buf = memoryview(src.view(0, self.size))
            self.base = 0
        else:
            self.buf = memoryview(b"")
            self.base = 0

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, field: str) -> int:
        """Make ``n`` bytes at ``pos`` addressable; return their index in ``buf``."""
        if n > self.size - self.pos:
            raise TruncatedError(f"needs {n} bytes but only {self.size - self.pos} remain", path=self.path,
                                 field=field, offset=self.pos)
        rel = self.pos - self.base
        if rel + n > len(self.buf) or rel < 0:
            k = min(self.size - self.pos, max(n, self.WINDOW))
            self.buf = memoryview(self.src.read(self.pos, k))
            self.base = self.pos
            rel = 0
        return rel

    def u32(self, field: str) -> int:
        i = self.need(4, field)
        self.pos += 4
        return _U32.unpack_from(self.buf, i)[0]

    def u64(self, field: str) -> int:
        i = self.need(8, field)
        self.pos += 8
        return _U64.unpack_from(self.buf, i)[0]

    def scalar(self, fmt: str, n: int, field: str):
        i = self.need(n, field)
        self.pos += n
        return struct.unpack_from(fmt, self.buf, i)[0]

    def raw(self, n: int, field: str) -> bytes:
        i = self.need(n, field)
        self.pos += n
        return bytes(self.buf[i:i + n])

    def string(self, field: str, limit: int = MAX_STRING_LEN):
        at = self.pos
        n = self.u64(field + " length")
        if n > limit:
            raise FormatError(f"string length {n} exceeds the limit of {limit} bytes", path=self.path,
                              field=field, offset=at)
        if n > self.remaining():
            raise TruncatedError(f"string of {n} bytes but only {self.remaining()} remain", path=self.path,
                                 field=field, offset=at)
        b = self.raw(n, field)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b  # kept as bytes: some vocabularies hold byte sequences that are not UTF-8


def _err(cls, reason, path, field, offset, **kw):
    return cls(reason, path=path, field=field, offset=offset, **kw)


def _read_strings(cur: _Cursor, n: int, field: str) -> list:
    """A string array, parsed in C window by window (a 150,000-token vocabulary takes milliseconds);
    a string that does not fit the window is read (and its length checked) by the Python path."""
    from mcf.gguf import _gguf

    out: list = []
    while len(out) < n:
        rel = cur.pos - cur.base
        if 0 <= rel <= len(cur.buf):
            k, end, _ = _gguf.parse_strings(cur.buf, rel, n - len(out), MAX_STRING_LEN, out)
            cur.pos = cur.base + end
            if k:
                continue
        out.append(cur.string(f"{field}[{len(out)}]"))  # raises the right error, or refills the window
    return out


def _read_value(cur: _Cursor, vtype: int, field: str, depth: int = 0):
    at = cur.pos
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        v = cur.scalar(fmt, struct.calcsize(fmt), field)
        return bool(v) if vtype == _VT_BOOL else v
    if vtype == _VT_STRING:
        return cur.string(field)
    if vtype == _VT_ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise _err(FormatError, f"arrays nested deeper than {MAX_ARRAY_DEPTH}", cur.path, field, at)
        etype = cur.u32(field + " element type")
        n = cur.u64(field + " element count")
        if etype in _ARRAY_NUMPY:
            itemsize = np.dtype(_ARRAY_NUMPY[etype]).itemsize
        elif etype == _VT_STRING:
            itemsize = 8
        elif etype == _VT_ARRAY:
            itemsize = 12
        else:
            raise _err(FormatError, f"unknown array element type {etype}", cur.path, field, at + 8,
                       expected="0..12")
        if n > MAX_ARRAY_LEN:
            raise _err(FormatError, f"array of {n} elements exceeds the limit of {MAX_ARRAY_LEN}", cur.path,
                       field, at + 4)
        if n * itemsize > cur.remaining():  # each element takes at least itemsize bytes
            raise _err(TruncatedError, f"array of {n} {VALUE_TYPE_NAMES[etype]} needs at least "
                       f"{n * itemsize} bytes but only {cur.remaining()} remain", cur.path, field, at + 4)
        if etype in _ARRAY_NUMPY:
            i = cur.need(n * itemsize, field)
            a = np.frombuffer(cur.buf, dtype=_ARRAY_NUMPY[etype], count=n, offset=i).copy()
            cur.pos += n * itemsize
            return a
        if etype == _VT_STRING:
            return _read_strings(cur, n, field)
        return [_read_value(cur, _VT_ARRAY, f"{field}[{k}]", depth + 1) for k in range(n)]
    raise _err(FormatError, f"unknown value type {vtype}", cur.path, field, at - 4, expected="0..12")


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor's bytes are and what they hold.

    ``dims`` is GGUF's order (fastest-varying first); ``shape`` is the row-major (numpy) shape, the
    reverse.  ``offset`` is absolute in the file; ``nbytes`` the exact byte count of the blocks."""

    name: str
    type: GGMLType
    dims: tuple
    shape: tuple
    offset: int
    nbytes: int
    n_elements: int

    @property
    def ggml_type(self) -> str:
        return self.type.name

    @property
    def row_elements(self) -> int:
        """Elements per index of the first (row-major) axis."""
        if not self.shape:
            return 1
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n


class GGUFFile(ClosedOnExit):
    """An open GGUF file: ``metadata`` (key -> value), ``tensors`` (name -> :class:`GGUFTensor`, file
    order), zero-copy ``raw()`` views and ``dequantize()``.  Use :func:`open`."""

    def __init__(self, source, *, path=None, own: bool = True):
        self._src = source
        self._own = own
        self.path = path if path is not None else source.name
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.metadata: dict = {}
        self.value_types: dict = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._parse()

    # -- parsing ---------------------------------------------------------------------------------
    def _parse(self):
        path = self.path
        cur = _Cursor(self._src, path)
        magic = cur.raw(4, "magic") if cur.remaining() >= 4 else None
        if magic is None:
            raise TruncatedError(f"file of {cur.size} bytes is too short for a GGUF header", path=path,
                                 field="magic", offset=0)
        if magic != MAGIC:
            raise FormatError("not a GGUF file", path=path, field="magic", offset=0, expected=MAGIC, got=magic)
        version = cur.u32("version")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):
                raise UnsupportedVersionError("big-endian GGUF files are not supported", path=path,
                                              field="version", offset=4, expected="2 or 3 little-endian",
                                              got=f"{swapped} big-endian")
            raise UnsupportedVersionError("unsupported GGUF version" + (" (v1 used 32-bit counts)"
                                                                       if version == 1 else ""),
                                          path=path, field="version", offset=4, expected="2 or 3", got=version)
        self.version = version
        n_tensors = cur.u64("tensor_count")
        n_kv = cur.u64("kv_count")
        if n_tensors > MAX_TENSORS:
            raise FormatError(f"tensor count exceeds the limit of {MAX_TENSORS}", path=path, field="tensor_count",
                              offset=8, got=n_tensors)
        if n_kv > MAX_KV:
            raise FormatError(f"metadata count exceeds the limit of {MAX_KV}", path=path, field="kv_count",
                              offset=16, got=n_kv)
        # smallest possible entries: kv = key length (8) + type (4) + 1-byte value; tensor info =
        # name length (8) + n_dims (4) + type (4) + offset (8)
        if n_kv * 13 + n_tensors * 24 > cur.remaining():
            raise TruncatedError(f"{n_kv} metadata entries and {n_tensors} tensor infos cannot fit in the "
                                 f"{cur.remaining()} bytes left", path=path, field="kv_count", offset=16)
        meta, vtypes = {}, {}
        for k in range(n_kv):
            at = cur.pos
            key = cur.string(f"metadata[{k}].key", MAX_KEY_LEN)
            if isinstance(key, bytes):
                raise FormatError("metadata key is not UTF-8", path=path, field=f"metadata[{k}].key", offset=at)
            if key in meta:
                raise FormatError(f"duplicate metadata key {key!r}", path=path, field=f"metadata[{k}].key",
                                  offset=at)
            vt = cur.u32(f"metadata[{key}].type")
            if vt not in VALUE_TYPE_NAMES:
                raise FormatError(f"unknown value type {vt}", path=path, field=f"metadata[{key}].type",
                                  offset=cur.pos - 4, expected="0..12")
            if vt == _VT_ARRAY:
                et = cur.scalar("<I", 4, f"metadata[{key}]")
                cur.pos -= 4
                vtypes[key] = ("array", VALUE_TYPE_NAMES.get(et, str(et)))
            else:
                vtypes[key] = VALUE_TYPE_NAMES[vt]
            meta[key] = _read_value(cur, vt, f"metadata[{key}]")
        self.metadata = meta
        self.value_types = vtypes
        if "general.alignment" in meta:
            a = meta["general.alignment"]
            if vtypes["general.alignment"] != "uint32" or not 0 < a <= MAX_ALIGNMENT or a & (a - 1):
                raise FormatError("general.alignment must be a uint32 power of two", path=path,
                                  field="general.alignment", expected=f"1..{MAX_ALIGNMENT}, power of two",
                                  got=f"{a!r} ({vtypes['general.alignment']})")
            self.alignment = a
        infos = []
        for k in range(n_tensors):
            at = cur.pos
            name = cur.string(f"tensor[{k}].name", MAX_KEY_LEN)
            if isinstance(name, bytes):
                raise FormatError("tensor name is not UTF-8", path=path, field=f"tensor[{k}].name", offset=at)
            fld = f"tensor[{name!r}]"
            n_dims = cur.u32(fld + ".n_dims")
            if n_dims > MAX_DIMS:
                raise FormatError(f"{n_dims} dimensions (GGUF allows at most {MAX_DIMS})", path=path,
                                  field=fld + ".n_dims", offset=cur.pos - 4)
            dims = tuple(cur.u64(f"{fld}.dims[{i}]") for i in range(n_dims))
            tcode = cur.u32(fld + ".type")
            if tcode not in _TYPES:
                raise DTypeError(f"{path}: {fld}.type at offset {cur.pos - 4}: unknown ggml type code {tcode} "
                                 f"(known: {known_types()})")
            rel = cur.u64(fld + ".offset")
            infos.append((name, dims, _TYPES[tcode], rel, at))
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        size = cur.size
        tensors = {}
        for name, dims, t, rel, at in infos:
            fld = f"tensor[{name!r}]"
            if name in tensors:
                raise FormatError(f"duplicate tensor name {name!r}", path=path, field=fld, offset=at)
            n, nz = 1, 1
            for d in dims:
                n *= d
                if d:
                    nz *= d
            if nz > MAX_ELEMENTS:
                raise FormatError(f"dims {list(dims)} hold more than 2**59 elements", path=path, field=fld + ".dims",
                                  offset=at)
            d0 = dims[0] if dims else 1
            if d0 % t.block:
                raise FormatError(f"first dimension {d0} is not a multiple of the {t.name} block size {t.block}",
                                  path=path, field=fld + ".dims", offset=at)
            nbytes = n // t.block * t.size
            if rel % self.alignment:
                raise FormatError(f"data offset {rel} is not a multiple of the alignment {self.alignment}",
                                  path=path, field=fld + ".offset", offset=at)
            start = self.data_offset + rel
            if start + nbytes > size:
                raise TruncatedError(f"data [{start}, {start + nbytes}) runs past the end of the file ({size} "
                                     "bytes)", path=path, field=fld + ".offset", offset=at)
            shape = tuple(reversed(dims))
            tensors[name] = GGUFTensor(name, t, dims, shape, start, nbytes, n)
        spans = sorted((ti.offset, ti.offset + ti.nbytes, ti.name) for ti in tensors.values() if ti.nbytes)
        for (s0, e0, n0), (s1, e1, n1) in itertools.pairwise(spans):
            if s1 < e0:
                raise FormatError(f"tensor {n1!r} [{s1}, {e1}) overlaps tensor {n0!r} [{s0}, {e0})", path=path,
                                  field=f"tensor[{n1!r}].offset")
        self.tensors = tensors

    # -- access ----------------------------------------------------------------------------------
    @property
    def source(self):
        return self._src

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"<GGUFFile {self.path!s} v{self.version}: {len(self.tensors)} tensors, {len(self.metadata)} keys>"

    def info(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array: zero-copy when the file is mapped or in
        memory, a fresh buffer otherwise."""
        t = self.info(name)
        with allocating(t.nbytes, self.path, name, source=self._src):
            return self._src.view(t.offset, t.nbytes)

    def array(self, name: str) -> np.ndarray:
        """A plain (F32, F16, BF16 as uint16 bits, F64, I8..I64) tensor as a row-major array, zero-copy
        when mapped.  Quantized types need :meth:`dequantize`."""
        t = self.info(name)
        dt = t.type.numpy
        if dt is None:
            raise DTypeError(f"{self.path}: tensor {name!r} is {t.type.name}; use dequantize()")
        return self.raw(name).view(dt).reshape(t.shape)

    def dequantize(self, name: str, dtype=np.float32, *, rows=None, out=None, impl=None, threads: int = 1):
        """Decode a tensor to float32 (or float16 / bfloat16 with ``dtype``), row-major.

        ``rows`` (``(start, stop)`` or a slice) selects a range of the first axis; the result then has
        shape ``(stop - start, *shape[1:])``.  ``out`` receives the values (any C-contiguous array of
        the right size and dtype) so a caller can decode into memory it already holds.  ``threads``
        splits the work (the GIL is released).  ``impl`` forces a kernel variant (see
        :func:`mcf.kernel_info`)."""

        t = self.info(name)
        if t.type.kind not in ("float", "quant"):
            raise DTypeError(f"{self.path}: tensor {name!r} has ggml type {t.type.name}, which mcf cannot "
                             f"decode (supported: {', '.join(SUPPORTED_TYPES)})")
        r0, r1 = row_range(rows, t.shape[0] if t.shape else 1)
        per_row = t.row_elements
        e0, e1 = r0 * per_row, r1 * per_row
        oshape = (r1 - r0, *t.shape[1:]) if t.shape else ()
        dt = _out_dtype(dtype if out is None else out.dtype)
        if out is not None:
            if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
                raise InvalidArgumentError("out must be a writeable C-contiguous numpy array")
            if out.size != e1 - e0:
                raise InvalidArgumentError(f"out has {out.size} elements, rows {r0}..{r1} of {name!r} need "
                                           f"{e1 - e0}")
        b = t.type.block
        b0, b1 = e0 // b, -(-e1 // b)
        cut = bool(e0 % b or e1 % b)   # only 1-D tensors can cut a block: decode the covering blocks
        need = ((0 if out is not None else (e1 - e0) * dt.itemsize) + ((b1 - b0) * b * dt.itemsize if cut else 0)
                + (0 if self._src.is_mapped else (b1 - b0) * t.type.size))   # the blocks, read
        with allocating(need, self.path, name):
            if out is None:
                out = np.empty(oshape, dtype=dt)
            if e1 == e0:
                return out
            if cut:
                tmp = np.empty((b1 - b0) * b, dtype=dt)
                self._decode_blocks(t, b0, b1, tmp, threads, impl)
                out.reshape(-1)[:] = tmp[e0 - b0 * b:e1 - b0 * b]
                return out
            self._decode_blocks(t, b0, b1, out.reshape(-1), threads, impl)
            return out

    def _decode_blocks(self, t: GGUFTensor, b0: int, b1: int, flat_out, threads, impl):
        from mcf.gguf import _gguf

        src = self._src.view(t.offset + b0 * t.type.size, (b1 - b0) * t.type.size)
        _gguf.dequantize_blocks(src, t.type.code, b1 - b0, flat_out, threads=threads, impl=impl)

    def close(self) -> None:
        """Close the file.  Views handed out earlier stay valid."""
        if self._own:
            self._src.close()


def _out_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype.lower() in ("bf16", "bfloat16"):
        return np.dtype(np.uint16)
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return dt
    if byte_order_problem(dt, "the output dtype"):
        raise InvalidArgumentError(byte_order_problem(dt, "the output dtype"))
    if dt not in (np.float32, np.float16, np.uint16):
        raise InvalidArgumentError(f"output dtype must be float32, float16 or bfloat16, got {dt}")
    return dt


def open(obj, *, mmap: bool | None = None) -> GGUFFile:
    """Open a GGUF file: a path, ``bytes``/``bytearray``/``memoryview`` holding the file, a binary
    file object, a URL, or an existing :class:`mcf.io.Source` (left open on close).  A path is mapped
    on a local disk and read with positional reads on a network or FUSE filesystem (``mmap=None``, the
    default; ``mmap=True``/``False`` decides instead).  Raises only :class:`mcf.MCFError`
    subclasses on a bad file."""
    from mcf.io import Source, open_source

    own = not isinstance(obj, Source)
    if isinstance(obj, bytes):
        obj = memoryview(obj)
    src = open_source(obj, mmap=mmap)
    try:
        g = GGUFFile(src, path=src.path if src.path is not None else src.name, own=own)
    except MCFError:
        if own:
            src.close()
        raise
    except (struct.error, ValueError, OverflowError, MemoryError) as exc:  # defensive: never leak these
        if own:
            src.close()
        raise FormatError(f"malformed GGUF file ({type(exc).__name__}: {exc})", path=src.name) from None
    return g


# -- conversion to MCF ------------------------------------------------------------------------------
