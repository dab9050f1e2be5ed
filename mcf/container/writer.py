"""Writing MCF containers, streaming and atomically.

Sections are written in the order they are added, each on an 8-byte boundary; tensors stream into one
TensorData section (each aligned to ``align`` bytes by absolute file offset); :meth:`Writer.close`
appends the TensorIndex, the QuantInfo (when there are records) and the section directory sorted by
type, then writes the header.  This is the Go reference writer's order, which is what lets
:func:`mcf.pack` reproduce its files byte for byte.

Nothing is visible at the destination until :meth:`Writer.close` succeeds: data goes to a temporary
file next to it, which is fsynced and renamed over the destination.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

import numpy as np

from mcf._core import _fpconv
from mcf._core.lifetime import PublishedOnExit
from mcf._core.fs import create_temp, fsync_file, publish
from mcf._core.args import file_path, integer
from mcf._core.dtypes import DType, DTypeInfo, from_numpy, parse_dtype
from mcf.errors import DTypeError, InvalidArgumentError, MCFError, in_tensor, os_error
from mcf.container.layout import (DIR_ENTRY, FLAG_TENSOR_DATA_ALIGNED64, HEADER, HEADER_SIZE, MAGIC, MAJOR, MINOR,
                        RESOURCE_BY_FILE, SECTION_ALIGN, TENSOR_ALIGN, Domain, SectionType, align,
                        tensor_nbytes)
from mcf.container.modelinfo import ModelInfo, encode_model_info
from mcf.container.quantinfo import QuantRecord, encode_quant_info
from mcf.container.tensor_index import encode_tensor_index

__all__ = ["Writer"]

_CHUNK_ELEMS = 1 << 22  # elements converted per step when casting: bounded memory for any tensor


@dataclass
class _Rec:
    name: str
    dtype: int
    shape: tuple
    offset: int
    nbytes: int
    quant: dict | None = None


class Writer(PublishedOnExit):
    """Write an MCF file.

    ``align`` is the alignment of each tensor's data (64 by default; 1 turns padding off like the Go
    packer's ``--tensor-align 1``).  ``dedup=True`` stores byte-identical tensors (same dtype, shape and
    bytes) once and points every index entry at the same range.  Use as a context manager: leaving the
    block with an exception removes the temporary file and leaves the destination untouched.

    ``durable=True`` (the default) fsyncs the file and its directory around the rename, so a published
    file survives a power loss; ``durable=False`` keeps the atomic rename (a crashed process still never
    leaves a half-written file at the path) but lets the kernel write the bytes back when it likes, as a
    plain file copy does.
    """

    def __init__(self, path, *, align: int = TENSOR_ALIGN, dedup: bool = False, atomic: bool = True,
                 durable: bool = True):
        if int(align) < 1:
            raise InvalidArgumentError(f"align must be >= 1, got {align}")
        from mcf.remote import refuse_url

        refuse_url(path, what="writing an MCF file")
        self.path = file_path(path, "path")
        self.align = int(align)
        self.dedup = bool(dedup)
        self._atomic = atomic
        self._durable = bool(durable)
        self._sections: list[tuple[int, int, int, int]] = []
        self._tensors: list[_Rec] = []
        self._names: set[str] = set()
        self._flags = 0
        self._td_start: int | None = None   # offset of the open TensorData section
        self._td_done = False
        self._dedup_table: dict = {}
        self._closed = False
        d = os.path.dirname(os.path.abspath(self.path))
        try:
            if atomic:
                fd, self._tmp = create_temp(d, os.path.basename(self.path))
                self._f = os.fdopen(fd, "w+b")
            else:
                self._tmp = self.path
                self._f = open(self.path, "w+b")  # noqa: SIM115
        except OSError as exc:
            raise os_error(exc, self.path) from None
        self._f.write(b"\0" * HEADER_SIZE)
        self._pos = HEADER_SIZE

    # -- low level --------------------------------------------------------------------------
    def _write(self, data) -> None:
        mv = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
        self._f.write(mv)
        self._pos += len(mv)

    def _pad_to(self, a: int) -> None:
        pad = align(self._pos, a) - self._pos
        if pad:
            self._write(b"\0" * pad)

    def _check_open(self):
        if self._closed:
            raise MCFError(f"{self.path}: writer is closed")

    def _end_tensor_data(self):
        if self._td_start is not None and not self._td_done:
            self._sections.append((SectionType.TENSOR_DATA, 1, self._td_start, self._pos - self._td_start))
            self._td_done = True

    # -- sections ---------------------------------------------------------------------------
    def add_section(self, type_: int, payload, *, version: int = 1) -> None:
        """Append a section with the given type code and payload bytes."""
        self._check_open()
        type_ = int(type_)
        if type_ in (SectionType.TENSOR_INDEX, SectionType.TENSOR_DATA, SectionType.QUANT_INFO):
            raise InvalidArgumentError(f"section 0x{type_:04x} is written by the writer itself")
        if any(t == type_ for t, *_ in self._sections) and type_ in (
                SectionType.MODEL_INFO, *RESOURCE_BY_FILE.values()):
            raise InvalidArgumentError(f"section 0x{type_:04x} was already written")
        if not 0 <= type_ <= 0xFFFFFFFF:
            raise InvalidArgumentError(f"section type {type_} outside uint32")
        self._end_tensor_data()
        self._pad_to(SECTION_ALIGN)
        start = self._pos
        self._write(payload)
        self._sections.append((type_, int(version), start, self._pos - start))

    def add_resource(self, name, data) -> None:
        """Store a resource file ("config.json", "tokenizer.json", ...; or a section type code).
        ``data`` is bytes, str (UTF-8) or a JSON-able object (encoded compactly)."""
        if isinstance(name, str):
            if name not in RESOURCE_BY_FILE:
                raise InvalidArgumentError(f"unknown resource {name!r}; expected one of {sorted(RESOURCE_BY_FILE)}")
            type_ = RESOURCE_BY_FILE[name]
        else:
            type_ = int(name)
        if isinstance(data, str):
            data = data.encode("utf-8")
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            import json

            data = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self.add_section(type_, data)

    def add_model_info(self, mi: ModelInfo) -> None:
        self.add_section(SectionType.MODEL_INFO, encode_model_info(mi))

    # -- tensors ----------------------------------------------------------------------------
    def _begin_tensor(self, name: str, info: DTypeInfo, shape: tuple) -> int:
        self._check_open()
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"tensor names must be non-empty strings, got {name!r}")
        if name in self._names:
            raise InvalidArgumentError(f"tensor {name!r} was already added")
        if self._td_done:
            raise InvalidArgumentError("tensors must be added together: a section was written after "
                                       "the tensor data")
        for d in shape:
            if d < 0:
                raise InvalidArgumentError(f"tensor {name!r}: negative dimension in {shape}")
        if self._td_start is None:
            self._pad_to(SECTION_ALIGN)
            self._td_start = self._pos
            if self.align % 64 == 0:
                self._flags |= FLAG_TENSOR_DATA_ALIGNED64
        a = self.align
        if info.quantized:
            a = max(a, 64) if a % 64 == 0 else 64 * a // np.gcd(64, a)
            self._flags |= FLAG_TENSOR_DATA_ALIGNED64
        self._pad_to(a)
        return self._pos

    def _finish_tensor(self, name, info, shape, start, hasher, quant=None):
        nbytes = self._pos - start
        offset = start
        if self.dedup and hasher is not None:
            key = (info.code, shape, nbytes, hasher.digest())
            prev = self._dedup_table.get(key)
            if prev is not None and self._same_bytes(prev, start, nbytes):
                self._f.truncate(start)
                self._f.seek(start)
                self._pos = start
                offset = prev
            else:
                self._dedup_table[key] = start
        self._tensors.append(_Rec(name, info.code, shape, offset, nbytes, quant))
        self._names.add(name)

    def _same_bytes(self, a: int, b: int, n: int) -> bool:
        self._f.flush()
        step = 1 << 20
        for o in range(0, n, step):
            k = min(step, n - o)
            if os.pread(self._f.fileno(), k, a + o) != os.pread(self._f.fileno(), k, b + o):
                return False
        return True

    def add_tensor(self, name: str, array, *, dtype=None, method=None, compat: bool = False, fast: bool = False,
                   importance=None, min_clip: float | None = None, max_clip: float | None = None) -> None:
        """Add a tensor from an array.

        ``dtype`` is the dtype to store (None: the array's own).  A float array (float16, bfloat16,
        float32, float64) is cast to another of these four on the way, rounded once to nearest even
        (from float64 too), with the function :func:`mcf.convert`'s ``dtype=`` uses: beyond the
        target's range is infinity, NaN stays NaN.  Any other pair (a float array as "f8_e4m3", "f4" or
        "i8", an integer or FP8 array as "f16", ...) is refused with :class:`mcf.DTypeError`: mcf never
        stores a dtype other than the one asked for.  Big-endian arrays are stored as their values
        (little-endian, as MCF requires).  An ``ml_dtypes`` array (bfloat16, float8_*) is stored as its
        MCF dtype (BF16, F8_*).
        ``method`` ("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4") quantizes a rank-2 float tensor
        (other tensors are stored plain), with ``compat``, ``fast``, ``importance``, ``min_clip`` and
        ``max_clip`` as in :func:`mcf.container.quant.quantize`; its QuantInfo record is written with the file.
        """
        a = np.asarray(array)
        if a.dtype.byteorder == ">":  # the values count, not their byte order: MCF stores little-endian
            a = a.astype(a.dtype.newbyteorder("<"))
        if method is not None:
            minfo = parse_dtype(method)
            if not minfo.quantized:
                raise InvalidArgumentError(f"method must be a quantization method, got {method!r}")
            is_float = a.dtype.name == "bfloat16" or a.dtype.kind == "f"
            if a.ndim == 2 and is_float:
                from mcf.container.quant import quantize

                try:
                    payload, q = quantize(a, minfo, compat=compat, fast=fast, importance=importance,
                                          min_clip=min_clip, max_clip=max_clip)
                except MCFError as exc:  # which tensor of the file being written
                    raise in_tensor(exc, None, name) from exc
                self.add_tensor_bytes(name, minfo, a.shape, payload, quant=q)
                return
        src = from_numpy(a.dtype)
        target = src if dtype is None else parse_dtype(dtype)
        if target.quantized:
            raise InvalidArgumentError(
                f"tensor {name!r}: quantized dtypes need add_tensor_bytes() with a ready payload")
        if target.code != src.code and not (src.family == "float" and target.family == "float"):
            raise DTypeError(f"{self.path}: tensor {name!r}: cannot store {src.name} values as {target.name}; "
                             + _cast_hint(src, target))
        shape = tuple(int(d) for d in a.shape)
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        start = self._begin_tensor(name, target, shape)
        hasher = hashlib.sha256() if self.dedup else None
        flat = a.reshape(-1)
        if target.code == src.code:
            data = flat.view(np.uint8)
            self._write(data)
            if hasher:
                hasher.update(data)
        else:
            for i in range(0, flat.size, _CHUNK_ELEMS):
                chunk = cast_chunk(flat[i:i + _CHUNK_ELEMS], src, target)
                self._write(chunk)
                if hasher:
                    hasher.update(chunk)
        self._finish_tensor(name, target, shape, start, hasher)

    def add_tensor_bytes(self, name: str, dtype, shape, data, *, quant: dict | None = None) -> None:
        """Add a tensor from its finished payload (any buffer, or an iterable of buffers to stream).

        For quantized dtypes ``data`` is the payload laid out as :func:`mcf.quant_layout` describes and
        ``quant`` may give the QuantInfo fields (``min_clip``, ``max_clip``, ``domain``); the block-scaled
        extensions (mxfp4, nvfp4, f8_e4m3_b128) have no QuantInfo record.
        """
        info = parse_dtype(dtype)
        shape = tuple(integer(d, "every dimension of shape") for d in shape)
        if info.scaled and quant is not None:
            raise InvalidArgumentError(f"tensor {name!r}: {info.name} tensors have no QuantInfo record (its method "
                                       "field is one byte, and the extension codes start at 0x8000): pass quant=None")
        domain = int((quant or {}).get("domain", Domain.WEIGHTS))
        for key in ("min_clip", "max_clip"):  # stored as f32: refuse what cannot be, before writing
            v = (quant or {}).get(key, 0.0)
            if not _f32_storable(v):
                raise InvalidArgumentError(f"tensor {name!r}: quant[{key!r}] = {v!r} is not a float32 value")
        try:
            want = tensor_nbytes(info, shape, domain=domain)
        except ValueError as exc:
            raise InvalidArgumentError(f"tensor {name!r}: {exc}") from None
        start = self._begin_tensor(name, info, shape)
        hasher = hashlib.sha256() if self.dedup else None
        single = isinstance(data, (bytes, bytearray, memoryview, np.ndarray, np.generic))
        chunks = [data] if single else data
        try:
            for c in chunks:
                mv = _as_bytes(c)
                self._write(mv)
                if hasher:
                    hasher.update(mv)
                if self._pos - start > want:
                    break
        finally:
            got = self._pos - start
        if got != want:
            self._f.truncate(start)
            self._f.seek(start)
            self._pos = start
            raise InvalidArgumentError(f"tensor {name!r}: payload is {got} bytes, {info.name} "
                                       f"{list(shape)} needs {want}")
        q = None
        if info.quantized and quant is not None:  # QuantInfo records are optional (spec)
            q = {"domain": domain, "min_clip": 0.0, "max_clip": 0.0, **quant}
        self._finish_tensor(name, info, shape, start, hasher, q)

    def alias(self, name: str, existing: str) -> None:
        """Add ``name`` as another index entry for the data of tensor ``existing``."""
        for r in self._tensors:
            if r.name == existing:
                break
        else:
            raise InvalidArgumentError(f"no tensor {existing!r} to alias")
        if name in self._names:
            raise InvalidArgumentError(f"tensor {name!r} was already added")
        self._tensors.append(_Rec(name, r.dtype, r.shape, r.offset, r.nbytes, r.quant))
        self._names.add(name)

    @property
    def tensor_count(self) -> int:
        return len(self._tensors)

    # -- finishing --------------------------------------------------------------------------
    def close(self) -> None:
        """Write index, QuantInfo and directory, then publish the file atomically."""
        if self._closed:
            return
        try:
            self._end_tensor_data()
            if self._tensors:
                if self._td_start is None:  # pragma: no cover - tensors imply tensor data
                    raise AssertionError
                idx = encode_tensor_index(self._tensors)
                self._pad_to(SECTION_ALIGN)
                start = self._pos
                self._write(idx)
                self._sections.append((SectionType.TENSOR_INDEX, 1, start, self._pos - start))
                order = sorted(self._tensors, key=lambda r: r.name.encode("utf-8"))
                recs = [
                    QuantRecord(i, r.dtype, r.quant["domain"],
                                32 if parse_dtype(r.dtype).family in ("block", "super") else 0,
                                256 if parse_dtype(r.dtype).family == "super" else 0,
                                float(r.quant["min_clip"]), float(r.quant["max_clip"]))
                    for i, r in enumerate(order) if r.quant is not None
                ]
                if recs:
                    self._pad_to(SECTION_ALIGN)
                    start = self._pos
                    self._write(encode_quant_info(recs))
                    self._sections.append((SectionType.QUANT_INFO, 1, start, self._pos - start))
            if not self._sections:
                raise InvalidArgumentError("an MCF file needs at least one section")
            self._pad_to(SECTION_ALIGN)
            dir_off = self._pos
            for t, v, o, s in sorted(self._sections, key=lambda x: x[0]):
                self._write(DIR_ENTRY.pack(t, v, o, s))
            size = self._pos
            self._f.seek(0)
            self._f.write(HEADER.pack(MAGIC, MAJOR, MINOR, HEADER_SIZE, len(self._sections), dir_off, size,
                                      self._flags))
            self._f.flush()
            if self._durable:
                fsync_file(self._f.fileno())
            self._f.close()
            if self._atomic:
                publish(self._tmp, self.path, durable=self._durable)
            self._closed = True
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard everything written; the destination is left as it was."""
        if self._closed:
            return
        self._closed = True
        try:
            self._f.close()
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)

    _publish_on_exit = close  # a with block that ends normally publishes; one left by an exception aborts


def _as_bytes(c) -> memoryview:
    """A flat byte view of a buffer or array chunk (numpy scalars and 0-d arrays included)."""
    if isinstance(c, (np.ndarray, np.generic)):
        a = np.asarray(c)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        return memoryview(a.reshape(-1).view(np.uint8))
    return memoryview(c).cast("B")


def _f32_storable(v) -> bool:
    """A real number that packs as f32 (infinities and NaN included, finite overflow not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        return False
    try:
        v = float(v)
    except OverflowError:
        return False
    return not math.isfinite(v) or abs(v) <= float(np.finfo(np.float32).max)


_CASTS = "f16, bf16, f32 and f64"


def _cast_hint(src: DTypeInfo, target: DTypeInfo) -> str:
    """What to do instead of a cast :meth:`Writer.add_tensor` does not make."""
    if src.family != "float":
        return (f"add_tensor casts between {_CASTS} only (as mcf.convert's dtype= does); pass dtype=None "
                f"to store the array as {src.name}, or convert it yourself first")
    if target.family in ("float8", "float4"):
        return (f"add_tensor casts between {_CASTS} only (as mcf.convert's dtype= does); encode the values "
                "yourself (e.g. with ml_dtypes) and pass that array, or the packed bytes to add_tensor_bytes()")
    return (f"add_tensor casts between {_CASTS} only (as mcf.convert's dtype= does); for 8-bit integer "
            "codes with scales use method='int8', or convert the array yourself first")


def cast_chunk(x: np.ndarray, src: DTypeInfo, dst: DTypeInfo) -> np.ndarray:
    """Convert a 1-D chunk between the float dtypes (F16, BF16, F32, F64) with round-to-nearest-even,
    quietly: beyond the target's range is infinity and NaN stays NaN, as a cast should (no RuntimeWarning
    escapes; the compiled converters raise none).  :func:`mcf.convert` and :meth:`Writer.add_tensor` both
    cast through here."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _cast_chunk(x, src, dst)


def _cast_chunk(x: np.ndarray, src: DTypeInfo, dst: DTypeInfo) -> np.ndarray:
    if src.code == DType.BF16:
        x32 = _fpconv.bf16_to_f32(x.view(np.uint16))
    elif src.code == DType.F16:
        x32 = _fpconv.f16_to_f32(x.view(np.uint16))
    elif src.code == DType.F64:
        x32 = x.astype(np.float32) if dst.code == DType.F32 else x
    else:
        x32 = x
    if dst.code == DType.F16:
        if src.code == DType.F64:
            return _fpconv.f64_to_f16(x)  # one rounding, from the exact value
        return _fpconv.f32_to_f16(x32)
    if dst.code == DType.BF16:
        if src.code == DType.F64:
            return _fpconv.f64_to_bf16(x)  # one rounding, from the exact value
        return _fpconv.f32_to_bf16(x32)
    if dst.code == DType.F32:
        return np.ascontiguousarray(x32, dtype="<f4")
    if dst.code == DType.F64:
        return np.asarray(x32, dtype="<f8")
    raise InvalidArgumentError(f"cannot cast {src.name} to {dst.name}")
