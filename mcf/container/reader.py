"""Reading MCF containers: header, section directory, resources, ModelInfo, QuantInfo and tensors.

Everything the file says is validated when it is opened (sizes, offsets, overlaps, dtype x shape),
with overflow-free Python integers, so that later reads can trust the index: a bad file raises a
:class:`mcf.FormatError` naming the field and offset, never a crash or a wrong array.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from mcf._core.args import byte_order_problem, out_array, row_range
from mcf.io import Source, open_source
from mcf._core.dtypes import DType
from mcf._core.memory import allocating
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import (DTypeError, FormatError, InvalidArgumentError, TruncatedError, UnknownNameError,
                        UnsupportedVersionError, in_tensor)
from mcf.container.layout import (DIR_ENTRY, DIR_ENTRY_SIZE, FLAG_TENSOR_DATA_ALIGNED64, HEADER, HEADER_SIZE, MAGIC,
                        MAJOR, MAX_SECTIONS, RESOURCE_BY_FILE, RESOURCE_FILES, SECTION_ALIGN, Domain,
                        SectionType, section_name)
from mcf.container.decode import decode_payload
from mcf.container.modelinfo import ModelInfo, decode_model_info
from mcf.container.quantinfo import QuantRecord, decode_quant_info
from mcf.container.tensor_index import TensorIndex, TensorInfo, cached_layout
from mcf.loading.arrays import load_arrays
from mcf.loading.casts import cast_into
from mcf.loading.dtypes import BF16_NUMPY as _BF16, ELEMENTS, element_of_mcf, numpy_dtype
from mcf.loading.plan import plain_piece

__all__ = ["Container", "Header", "Section", "open"]

_UNIQUE = {SectionType.MODEL_INFO, SectionType.QUANT_INFO, SectionType.TENSOR_INDEX,
           SectionType.TENSOR_DATA, *RESOURCE_FILES}


@dataclass(frozen=True)
class Header:
    magic: bytes
    major: int
    minor: int
    header_size: int
    section_count: int
    section_dir_offset: int
    file_size: int
    flags: int

    @property
    def aligned64(self) -> bool:
        return bool(self.flags & FLAG_TENSOR_DATA_ALIGNED64)


@dataclass(frozen=True)
class Section:
    type: int
    version: int
    offset: int
    size: int

    @property
    def name(self) -> str:
        return section_name(self.type)


def _parse_header(src: Source) -> Header:
    path = src.name
    size = src.size
    if size < HEADER_SIZE:
        raise TruncatedError("file shorter than the MCF header", path=path, field="header", offset=0,
                             expected=f">= {HEADER_SIZE} bytes", got=f"{size} bytes")
    h = Header(*HEADER.unpack(src.read(0, HEADER_SIZE)))
    if h.magic != MAGIC:
        raise FormatError("not an MCF file (bad magic)", path=path, field="magic", offset=0,
                          expected=MAGIC.hex(), got=h.magic.hex())
    if h.major != MAJOR:
        raise UnsupportedVersionError("unsupported major version", path=path, field="major", offset=4,
                                      expected=MAJOR, got=h.major)
    if h.file_size != size:
        raise TruncatedError("file_size does not match the real length (truncated or appended to?)",
                             path=path, field="file_size", offset=24, expected=size, got=h.file_size)
    if h.header_size < HEADER_SIZE or h.header_size > size:
        raise FormatError("bad header_size", path=path, field="header_size", offset=8,
                          expected=f"{HEADER_SIZE}..{size}", got=h.header_size)
    if h.section_count == 0 or h.section_count > MAX_SECTIONS:
        raise FormatError("bad section_count", path=path, field="section_count", offset=12,
                          expected=f"1..{MAX_SECTIONS}", got=h.section_count)
    dir_end = h.section_dir_offset + DIR_ENTRY_SIZE * h.section_count
    if h.section_dir_offset < h.header_size:
        raise FormatError("section directory starts inside the header", path=path,
                          field="section_dir_offset", offset=16, expected=f">= {h.header_size}",
                          got=h.section_dir_offset)
    if dir_end > size:
        raise TruncatedError("section directory outside the file", path=path,
                             field="section_dir_offset", offset=16,
                             expected=f"{h.header_size} <= offset and offset + {DIR_ENTRY_SIZE}*"
                                      f"{h.section_count} <= {size}", got=h.section_dir_offset)
    return h


def _parse_directory(src: Source, h: Header) -> list:
    path = src.name
    raw = src.read(h.section_dir_offset, DIR_ENTRY_SIZE * h.section_count)
    dir_lo, dir_hi = h.section_dir_offset, h.section_dir_offset + DIR_ENTRY_SIZE * h.section_count
    sections = []
    seen = set()
    for i in range(h.section_count):
        at = h.section_dir_offset + i * DIR_ENTRY_SIZE
        typ, ver, off, sz = DIR_ENTRY.unpack_from(raw, i * DIR_ENTRY_SIZE)
        field = f"section[{i}]({section_name(typ)})"
        if off % SECTION_ALIGN:
            raise FormatError("section offset is not 8-byte aligned", path=path, field=field + ".offset",
                              offset=at + 8, expected="multiple of 8", got=off)
        if off < h.header_size:
            raise FormatError("section starts inside the header", path=path, field=field + ".offset",
                              offset=at + 8, expected=f">= {h.header_size}", got=off)
        if off > h.file_size or sz > h.file_size - off:
            raise TruncatedError("section outside the file", path=path, field=field + ".offset",
                                 offset=at + 8, expected=f"[{h.header_size}, {h.file_size}]",
                                 got=f"[{off}, {off + sz})")
        if sz and off < dir_hi and dir_lo < off + sz:
            raise FormatError("section overlaps the section directory", path=path,
                              field=field + ".offset", offset=at + 8,
                              expected=f"outside [{dir_lo}, {dir_hi})", got=f"[{off}, {off + sz})")
        if typ in _UNIQUE:
            if typ in seen:
                raise FormatError("section type appears twice", path=path, field=field + ".type",
                                  offset=at, got=hex(typ))
            seen.add(typ)
            if ver != 1:
                raise UnsupportedVersionError("unsupported section version", path=path,
                                              field=field + ".version", offset=at + 4, expected=1, got=ver)
        sections.append(Section(typ, ver, off, sz))
    ordered = sorted((s for s in sections if s.size), key=lambda s: s.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.size:
            raise FormatError(f"sections {a.name} and {b.name} overlap", path=path,
                              field=f"section({b.name}).offset", offset=b.offset,
                              expected=f">= {a.offset + a.size}", got=b.offset)
    return sections


class Container(ClosedOnExit):
    """An open MCF file.  Use :func:`mcf.open`; close it (or use ``with``) when done.

    Arrays returned by :meth:`tensor` are zero-copy views when the file is mapped and stay valid after
    :meth:`close`.
    """

    def __init__(self, source: Source, *, owns_source: bool = True):
        self._src = source
        self._owns = owns_source
        self.path = source.name
        try:
            self.header = _parse_header(source)
            self.sections = tuple(_parse_directory(source, self.header))
            self._by_type = {s.type: s for s in self.sections}
            self._quant_records = None
            records = self._read_quant_info()
            domains = {r.tensor_index: r.domain for r in records} if records else None
            self.index = self._read_index(domains)
            if records:
                self._check_quant_records(records)
            self._mapped = source.is_mapped
        except BaseException:
            if owns_source:
                source.close()
            raise

    # -- sections ---------------------------------------------------------------------------------
    def section(self, type_: int) -> Section | None:
        """The directory entry of section ``type_`` (first one for repeated unknown types)."""
        return self._by_type.get(int(type_))

    def section_bytes(self, type_: int) -> bytes | None:
        s = self.section(type_)
        return None if s is None else self._section_data(s, copy=True)

    def _section_data(self, s, *, copy: bool = False):
        """The bytes of section ``s`` (a copy, or a view when mapped): their size comes from the file, so
        they are allocated under mcf's memory rule (:mod:`mcf._core.memory`)."""
        with allocating(s.size, self.path, None, source=None if copy else self._src, what=f"section {s.name}"):
            return self._src.read(s.offset, s.size) if copy else self._src.view(s.offset, s.size)

    def _read_index(self, domains) -> TensorIndex:
        s = self.section(SectionType.TENSOR_INDEX)
        if s is None:
            return TensorIndex([], [], 0)
        td = self.section(SectionType.TENSOR_DATA)
        if td is None:
            raise FormatError("file has a TensorIndex but no TensorData section", path=self.path,
                              field="section(TensorData)", offset=self.header.section_dir_offset)
        data = self._section_data(s)
        return TensorIndex.parse(data, path=self.path, base_offset=s.offset,
                                 data_range=(td.offset, td.size), domains=domains,
                                 aligned64=self.header.aligned64)

    def _read_quant_info(self):
        s = self.section(SectionType.QUANT_INFO)
        if s is None:
            return None
        return decode_quant_info(self._section_data(s, copy=True), path=self.path, base_offset=s.offset)

    def _check_quant_records(self, records):
        out = []
        seen = set()
        s = self.section(SectionType.QUANT_INFO)
        for i, r in enumerate(records):
            at = s.offset + 8 + 24 * i
            field = f"QuantInfo.record[{i}]"
            if r.tensor_index >= len(self.index):
                raise FormatError("record points at a tensor that does not exist", path=self.path,
                                  field=field + ".tensor_index", offset=at,
                                  expected=f"< {len(self.index)}", got=r.tensor_index)
            if r.tensor_index in seen:
                raise FormatError("two records for one tensor", path=self.path,
                                  field=field + ".tensor_index", offset=at, got=r.tensor_index)
            seen.add(r.tensor_index)
            t = self.index.position(r.tensor_index)
            if r.method != t.dtype.code:
                raise FormatError(f"method does not match the dtype of tensor {t.name!r}",
                                  path=self.path, field=field + ".method", offset=at + 4,
                                  expected=t.dtype.code, got=r.method)
            fam = t.dtype.family
            want = {"block": (0, 32, 0), "super": (0, 32, 256)}.get(fam)
            if want is not None and (r.domain, r.block_size, r.super_size) != want:
                raise FormatError(f"block geometry of {t.name!r} differs from the spec", path=self.path,
                                  field=field, offset=at + 5,
                                  expected="domain=%d block=%d super=%d" % want,
                                  got=f"domain={r.domain} block={r.block_size} super={r.super_size}")
            if fam == "raw" and r.domain not in (Domain.WEIGHTS, Domain.ACTIVATIONS):
                raise FormatError("unknown domain", path=self.path, field=field + ".domain",
                                  offset=at + 5, expected="0 or 1", got=r.domain)
            out.append(QuantRecord(r.tensor_index, r.method, r.domain, r.block_size, r.super_size,
                                   r.min_clip, r.max_clip, t.name))
        self._quant_records = out

    @property
    def flags(self) -> int:
        return self.header.flags

    @property
    def model_info(self) -> ModelInfo | None:
        s = self.section(SectionType.MODEL_INFO)
        if s is None:
            return None
        return decode_model_info(self._section_data(s, copy=True), path=self.path, base_offset=s.offset)

    @property
    def quant_info(self) -> list:
        """QuantInfo records, cross-checked against the tensor index, with tensor names filled in."""
        return list(self._quant_records or [])

    def quant_record(self, name: str) -> QuantRecord | None:
        t = self.index[name]
        for r in self._quant_records or ():
            if r.tensor_index == t.index:
                return r
        return None

    # -- resources ------------------------------------------------------------------------------
    def _resource_type(self, name) -> int:
        if isinstance(name, int):
            return name
        try:
            return RESOURCE_BY_FILE[name]
        except KeyError:
            raise UnknownNameError(f"unknown resource {name!r}; expected one of {sorted(RESOURCE_BY_FILE)}") from None

    def resource(self, name) -> bytes | None:
        """Raw bytes of a resource section ("config.json", "tokenizer.json", ... or a type code)."""
        return self.section_bytes(self._resource_type(name))

    def resource_text(self, name) -> str | None:
        b = self.resource(name)
        if b is None:
            return None
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as exc:
            s = self.section(self._resource_type(name))
            raise FormatError(f"resource is not valid UTF-8: {exc.reason}", path=self.path,
                              field=f"section({s.name})", offset=s.offset + exc.start) from None

    def resource_json(self, name):
        """A resource section parsed as JSON (``None`` when absent)."""
        b = self.resource(name)
        if b is None:
            return None
        s = self.section(self._resource_type(name))
        try:
            return json.loads(b)
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too many digits, too deep
            raise FormatError(f"resource is not valid JSON: {exc}", path=self.path,
                              field=f"section({s.name})", offset=s.offset) from None

    @property
    def resources(self) -> dict:
        """Every resource section present, file name -> bytes."""
        return {fname: self.section_bytes(t) for t, fname in RESOURCE_FILES.items() if t in self._by_type}

    # -- tensors --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self):
        return iter(self.index)

    def __contains__(self, name) -> bool:
        return name in self.index

    def keys(self):
        return self.index.keys()

    def info(self, name: str) -> TensorInfo:
        """Metadata of one tensor (dtype, shape, offset, size)."""
        return self.index[name]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as a numpy array of its dtype: zero-copy and read-only when mapped.

        BF16 comes back as ``ml_dtypes.bfloat16`` when that package is installed, else as the raw
        ``uint16`` bit patterns (see :meth:`to_float32`); the FP8 and E8M0 extension dtypes likewise as
        ``ml_dtypes``' float8 types or ``uint8`` bits.  F4 (two values per byte) has no numpy dtype: it is
        refused with :class:`mcf.DTypeError` (:meth:`dequantize` decodes it, :meth:`raw` gives its bytes).
        Quantized tensors are dequantized to a fresh float32 array (see :meth:`dequantize` for other dtypes,
        row ranges and ``out=``).
        """
        t = self.index[name]
        if t.dtype.quantized:
            return self.dequantize(name)
        if t.dtype.code == DType.BF16:
            dt = _BF16 if _BF16 is not None else t.dtype.numpy
        elif t.dtype.extension:   # FP8 as ml_dtypes' float8 types (their bits without it); F4 refused
            dt = numpy_dtype(element_of_mcf(t.dtype.code), f"{self.path}: tensor {name!r}")
        else:
            dt = t.dtype.numpy
        with allocating(t.nbytes, self.path, name, source=self._src):
            return self._src._typed_view(t.offset, t.nbytes, dt, t.shape)

    def load(self, names=None, *, threads=None, chunk_bytes=None) -> dict:
        """Read tensors (all of them by default) into fresh, writable arrays: name -> array, each its own
        memory.  Stored bytes as they are: quantized tensors come back as their raw payload (uint8); for
        decoded, cast or partial loads see :func:`mcf.load_file` and :func:`mcf.load_state_dict`.

        Every tensor's range goes to the read engine in one call (:meth:`mcf.io.Source.read_into`),
        straight into its array; ``threads``/``chunk_bytes`` tune the engine (None: chosen for the
        storage).
        """
        pieces = []
        for n in (self.index.keys() if names is None else names):
            t = self.index[n]
            if t.dtype.quantized:
                pieces.append(plain_piece(t.name, self._src, t.offset, (t.nbytes,), ELEMENTS["U8"], None))
            else:
                pieces.append(plain_piece(t.name, self._src, t.offset, t.shape, element_of_mcf(t.dtype.code), None))
        return load_arrays(pieces, threads=threads, chunk_bytes=chunk_bytes)

    def to_float32(self, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        """A plain float tensor (F32, F16, BF16, F64, and the FP8 / E8M0 / F4 extensions) converted to a fresh
        float32 array, or into ``out``: a writeable C-contiguous float32 array of the tensor's size (any shape),
        which is returned."""
        from mcf._core import _fpconv

        t = self.index[name]
        code = t.dtype.code
        if t.dtype.family in ("float8", "float4"):
            return self.dequantize(name, np.float32, out=out)
        if code not in (DType.F32, DType.F16, DType.BF16, DType.F64):
            raise DTypeError(f"{self.path}: tensor {name!r} ({t.dtype.name}) is not a plain float tensor")
        flat = None if out is None else out_array(out, np.float32, t.numel, "out")
        need = (0 if out is not None else t.numel * 4) + (0 if self._src.is_mapped else t.nbytes)
        with allocating(need, self.path, name):
            if code in (DType.BF16, DType.F16):
                conv = _fpconv.bf16_to_f32 if code == DType.BF16 else _fpconv.f16_to_f32
                res = conv(self._src.array(t.offset, np.uint16, t.shape), flat)
                return res if out is None else out
            a = self._src.array(t.offset, t.dtype.numpy, t.shape)
            with np.errstate(over="ignore"):  # F64 beyond the F32 range becomes inf, as a cast should
                if out is None:
                    return a.astype(np.float32)
                np.copyto(flat, a.reshape(-1), casting="same_kind")
            return out

    def dequantize(self, name: str, dtype=np.float32, *, rows=None, out: np.ndarray | None = None,
                   impl: str | None = None, threads: int = 1) -> np.ndarray:
        """Tensor ``name`` as float32, float16 or bfloat16, whatever its stored dtype.

        ``rows`` (``(start, stop)`` or a slice) decodes only those rows (indexes of the first dimension: a
        tensor-parallel shard; an expert range of an ``[E, out, in]`` mxfp4 stack); ``out`` receives the result
        in place (any C-contiguous array of the right size and dtype); ``threads`` splits rows across threads;
        ``impl`` forces a kernel variant ("scalar", "avx2", "avx512", "neon").  Quantized payloads and the FP8 / E8M0 /
        F4 extensions go through the compiled kernels; a NaN block scale (an E8M0 0xFF...) is a
        :class:`mcf.FormatError` naming the tensor and the scale.
        """
        t = self.index[name]
        dt = np.dtype(out.dtype if out is not None else dtype)
        with allocating(self._decoded_bytes(t, dt, rows, out), self.path, name):
            return self._dequantize(t, dt, rows, out, impl, threads)

    def _decoded_bytes(self, t, dt, rows, out) -> int:
        """What :meth:`dequantize` allocates: the result (unless ``out`` is given) and, from a source that is
        not mapped, the stored bytes it reads."""
        need = 0 if self._src.is_mapped else t.nbytes
        if out is None:
            if rows is None or not t.shape:
                need += t.numel * dt.itemsize
            else:
                r0, r1 = row_range(rows, t.shape[0], InvalidArgumentError)
                need += (r1 - r0) * math.prod(t.shape[1:]) * dt.itemsize
        return need

    def _dequantize(self, t, dt, rows, out, impl, threads) -> np.ndarray:
        name = t.name
        if t.dtype.quantized:
            rec = self.quant_record(name)
            r0, r1 = row_range(rows, t.shape[0], InvalidArgumentError)
            inner = math.prod(t.shape[1:-1])   # payload rows per index of the first dimension
            try:
                res = decode_payload(self.raw(name), t.dtype, t.shape, domain=rec.domain if rec else 0, dtype=dt,
                                     rows=(r0 * inner, r1 * inner), out=out, impl=impl, threads=threads)
            except FormatError as exc:   # a NaN block scale: which file, which tensor
                raise in_tensor(exc, self.path, name) from None
            return res if out is not None else res.reshape((r1 - r0,) + tuple(t.shape[1:]))
        if t.dtype.family in ("float8", "float4"):
            return self._decode_elements(t, dt, rows, out, impl)
        if t.dtype.family != "float":
            raise DTypeError(f"{self.path}: tensor {name!r} ({t.dtype.name}) is not a float tensor")
        if rows is not None:
            if len(t.shape) < 1:
                raise DTypeError(f"{self.path}: tensor {name!r} is a scalar; it has no rows")
            r0, r1 = row_range(rows, t.shape[0], InvalidArgumentError)
            src = self.tensor(name)[r0:r1]
        else:
            src = self.tensor(name)
        half = dt == np.float16 or dt.name == "bfloat16" or dt == np.uint16
        if byte_order_problem(dt, "the output dtype"):
            raise InvalidArgumentError(byte_order_problem(dt, "the output dtype"))
        if dt != np.float32 and not half:
            raise DTypeError(f"output dtype must be float32, float16 or bfloat16, got {dt}")
        if out is None:
            out = np.empty(src.shape, dt)
        elif out.size != src.size or not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgumentError(f"out must be a writeable C-contiguous array of {src.size} elements")
        cast_into(src, element_of_mcf(t.dtype.code).name, out)
        return out

    def _decode_elements(self, t, dt, rows, out, impl) -> np.ndarray:
        """An FP8 / E8M0 / F4 tensor (or ``rows`` of it) decoded to float32 / float16 / bfloat16."""
        from mcf._core import _mx

        shape = tuple(t.shape)
        r0, r1 = (0, 1) if not shape else row_range(rows, shape[0], InvalidArgumentError)
        if rows is not None and not shape:
            raise DTypeError(f"{self.path}: tensor {t.name!r} is a scalar; it has no rows")
        per_row = math.prod(shape[1:])
        e0, e1 = r0 * per_row, r1 * per_row
        if t.dtype.family == "float4":   # two values per byte: decode from the byte holding the first
            raw = self.raw(t.name)[e0 // 2:-(-e1 // 2)]
            vals = _mx.decode_elements(raw, t.dtype.code, count=e1 - e0 + e0 % 2, dtype=dt, impl=impl)[e0 % 2:]
            if out is None:
                return vals.reshape((r1 - r0,) + shape[1:] if shape else ())
            out_array(out, dt, vals.size)[...] = vals
            return out
        raw = self.raw(t.name)[e0:e1]
        res = _mx.decode_elements(raw, t.dtype.code, dtype=dt, out=None if out is None else out.reshape(-1),
                                  impl=impl)
        return res.reshape((r1 - r0,) + shape[1:] if shape else ()) if out is None else out

    def raw(self, name: str) -> np.ndarray:
        """The tensor's payload bytes as a uint8 array (zero-copy when mapped)."""
        t = self.index[name]
        with allocating(t.nbytes, self.path, name, source=self._src):
            return self._src.view(t.offset, t.nbytes)

    def quant_layout(self, name: str):
        t = self.index[name]
        if not t.dtype.quantized:
            raise DTypeError(f"{self.path}: tensor {name!r} ({t.dtype.name}) is not quantized")
        rec = self.quant_record(name)
        return cached_layout(t.dtype.code, t.shape, rec.domain if rec else 0)

    def quant_regions(self, name: str) -> dict:
        """The raw regions of a quantized tensor as arrays, keyed by region name:
        q*: ``scales`` (f16), ``data``; k*: ``super_scales`` (f16), ``sub_scales`` (u8), ``data``;
        int*: ``scale`` (f32), [``zero``], ``data``; mxfp4: ``scales`` (E8M0 bytes), ``data``; nvfp4: ``scale``
        (f32), ``scales`` (E4M3 bytes), ``data``; f8_e4m3_b128: ``scales`` (f32), ``data`` (E4M3 bytes).  Codes
        stay packed."""
        t = self.index[name]
        lay = self.quant_layout(name)
        with allocating(t.nbytes, self.path, name, source=self._src):
            return {r.name: self._src.array(t.offset + r.offset, r.dtype, (r.count,)) for r in lay.regions}

    # -- whole-file checks ---------------------------------------------------------------------
    def verify(self) -> list:
        """Checks beyond what opening does; returns a list of problems (empty when clean).

        Opening already validated the structure; this adds: resource JSON parses, ModelInfo decodes,
        tensor ranges overlap only when identical (dedup), quantized sub-scales use 6 bits, and stored
        scales (and int* zero points) are finite: the format has room for an infinite or NaN scale, and
        a decoder reads it back as inf/NaN weights without complaint, so only a check here finds it."""
        problems = []
        for t, fname in RESOURCE_FILES.items():
            if t in self._by_type and fname.endswith(".json"):
                try:
                    self.resource_json(fname)
                except FormatError as exc:
                    problems.append(str(exc))
        try:
            _ = self.model_info
        except FormatError as exc:
            problems.append(str(exc))
        ranges = sorted({(t.offset, t.nbytes) for t in self.index.values() if t.nbytes})
        for (o1, n1), (o2, n2) in zip(ranges, ranges[1:]):
            if o2 < o1 + n1:
                problems.append(f"{self.path}: tensor data ranges [{o1}, {o1 + n1}) and [{o2}, {o2 + n2}) "
                                "partially overlap")
        for t in self.index.values():
            if not t.dtype.quantized:
                continue
            if t.dtype.scaled:
                problems.extend(self._scaled_scale_problems(t))
                continue
            regions = self.quant_regions(t.name)
            if t.dtype.family == "super":
                sub = regions["sub_scales"]
                if sub.size and int(sub.max()) > 63:
                    problems.append(f"{self.path}: tensor {t.name!r}: sub-scale above 63 (top bits set)")
            for key, bits, exp in (("scales", "<u2", 0x7C00), ("super_scales", "<u2", 0x7C00),
                                   ("scale", "<u4", 0x7F800000), ("zero", "<u4", 0x7F800000)):
                if key not in regions:
                    continue
                bad = np.flatnonzero((regions[key].view(bits) & exp) == exp)  # on the bits: no float op
                if bad.size:
                    problems.append(f"{self.path}: tensor {t.name!r}: {bad.size} of {regions[key].size} {key} "
                                    f"infinite or NaN (first: {key}[{int(bad[0])}]); the tensor decodes to "
                                    "inf/NaN")
        return problems

    def _scaled_scale_problems(self, t) -> list:
        """verify() of an mxfp4 / nvfp4 / f8_e4m3_b128 tensor: a NaN scale (E8M0 0xFF, an E4M3 NaN, a float32
        NaN) makes its block NaN, and decoding refuses it; an infinite float32 scale decodes to inf/NaN."""
        from mcf._core import _mx

        out = []
        bad = _mx.first_nan_scale(self.raw(t.name), t.dtype.code, t.shape)
        if bad is not None:
            out.append(f"{self.path}: tensor {t.name!r}: {bad[0]} is NaN ({bad[1]}); decoding the tensor is refused")
        regions = self.quant_regions(t.name)
        for key in ("scale", "scales"):
            r = regions.get(key)
            if r is None or r.dtype != np.dtype("<f4"):
                continue
            inf = np.flatnonzero((r.view("<u4") & 0x7FFFFFFF) == 0x7F800000)
            if inf.size:
                out.append(f"{self.path}: tensor {t.name!r}: {inf.size} of {r.size} {key} infinite (first: "
                           f"{key}[{int(inf[0])}]); the tensor decodes to inf/NaN")
        return out

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def source(self) -> Source:
        return self._src

    @property
    def closed(self) -> bool:
        return self._src.closed

    def close(self) -> None:
        if self._owns:
            self._src.close()

    def __reduce__(self):
        return (Container, (self._src,))

    def __repr__(self) -> str:
        return f"<mcf.Container {self.path!r} {len(self)} tensors, {len(self.sections)} sections>"


def open(path_or_file, *, mmap: bool | None = None) -> Container:  # noqa: A001 - mirrors builtins.open
    """Open an MCF container from a path, a binary file-like object or an in-memory buffer.

    ``mmap=None`` (the default) maps a file on a local disk and reads one on a network or FUSE
    filesystem with positional reads, where page faults are round trips to a server
    (:func:`mcf.io.open_source`); ``mmap=True``/``False`` decides instead."""
    src = open_source(path_or_file, mmap=mmap)
    return Container(src, owns_source=not isinstance(path_or_file, Source))
