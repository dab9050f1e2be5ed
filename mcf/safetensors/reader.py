"""A validating safetensors reader over the I/O core (no dependency on the safetensors package).

Layout: ``u64 header_len | JSON header (header_len bytes) | data``.  The header maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data start, plus an optional
``__metadata__`` of strings.  Checks follow the safetensors library's own: header size cap, integer
fields, offsets inside the data, ``end - begin == numel * itemsize``, no overlaps.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from mcf._core._io import Source, open_source
from mcf._core.dtypes import DType, DTypeInfo, dtype_info
from mcf.errors import FormatError, MissingFileError, TruncatedError

__all__ = ["SafetensorsFile", "SafetensorsTensor", "open_checkpoint", "ST_DTYPES"]

MAX_HEADER = 100 * 1024 * 1024

ST_DTYPES = {
    "F32": DType.F32, "F16": DType.F16, "BF16": DType.BF16, "F64": DType.F64,
    "I8": DType.I8, "U8": DType.U8, "I16": DType.I16, "U16": DType.U16,
    "I32": DType.I32, "U32": DType.U32, "I64": DType.I64, "U64": DType.U64,
}


@dataclass(frozen=True)
class SafetensorsTensor:
    name: str
    dtype: DTypeInfo
    shape: tuple
    offset: int     # absolute offset in the file
    nbytes: int
    file: "SafetensorsFile"

    def array(self):
        """Zero-copy (when mapped) numpy view of the tensor's storage dtype."""
        return self.file.source.array(self.offset, self.dtype.numpy, self.shape)


class SafetensorsFile:
    def __init__(self, path_or_source, *, mmap: bool | None = None):
        self.source: Source = open_source(path_or_source, mmap=mmap)
        try:
            self.tensors, self.metadata = self._parse()
        except BaseException:
            self.source.close()
            raise

    def _parse(self):
        src = self.source
        path = src.name
        if src.size < 8:
            raise TruncatedError("file shorter than the 8-byte header length", path=path,
                                 field="header_len", offset=0, expected=">= 8 bytes", got=f"{src.size} bytes")
        (hlen,) = struct.unpack("<Q", src.read(0, 8))
        if hlen > MAX_HEADER or hlen > src.size - 8:
            raise FormatError("header length too large", path=path, field="header_len", offset=0,
                              expected=f"<= {min(MAX_HEADER, src.size - 8)}", got=hlen)
        try:
            header = json.loads(src.read(8, hlen))
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too many digits, too deep
            raise FormatError(f"header is not valid JSON: {exc}", path=path, field="header", offset=8) from None
        if not isinstance(header, dict):
            raise FormatError("header is not a JSON object", path=path, field="header", offset=8)
        data_start = 8 + hlen
        data_size = src.size - data_start
        meta = header.pop("__metadata__", None) or {}
        tensors = {}
        spans = []
        for name, ent in header.items():
            field = f"header[{name!r}]"
            if not isinstance(ent, dict):
                raise FormatError("tensor entry is not an object", path=path, field=field, offset=8)
            dt = ent.get("dtype")
            if not isinstance(dt, str) or dt not in ST_DTYPES:
                raise FormatError("unsupported dtype", path=path, field=field + ".dtype", offset=8,
                                  expected="one of " + ",".join(ST_DTYPES), got=dt)
            shape = ent.get("shape")
            offs = ent.get("data_offsets")
            if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                       and d >= 0 for d in shape)):
                raise FormatError("shape must be a list of non-negative integers", path=path,
                                  field=field + ".shape", offset=8, got=shape)
            if (not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
                raise FormatError("data_offsets must be [begin, end]", path=path,
                                  field=field + ".data_offsets", offset=8, got=offs)
            b, e = offs
            if not 0 <= b <= e <= data_size:
                raise TruncatedError("tensor data outside the file", path=path,
                                     field=field + ".data_offsets", offset=8,
                                     expected=f"0 <= begin <= end <= {data_size}", got=offs)
            info = dtype_info(ST_DTYPES[dt])
            want = math.prod(shape) * info.itemsize
            if e - b != want:
                raise FormatError("data size does not match dtype and shape", path=path,
                                  field=field + ".data_offsets", offset=8, expected=want, got=e - b)
            tensors[name] = SafetensorsTensor(name, info, tuple(shape), data_start + b, e - b, self)
            if e > b:
                spans.append((b, e, name))
        spans.sort()
        for (b1, e1, n1), (b2, e2, n2) in zip(spans, spans[1:]):
            if b2 < e1:
                raise FormatError(f"tensors {n1!r} and {n2!r} overlap", path=path,
                                  field=f"header[{n2!r}].data_offsets", offset=8)
        return tensors, meta

    def close(self):
        self.source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Checkpoint:
    """All tensors of a checkpoint directory: one ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json``."""

    def __init__(self, files: list, *, mmap: bool | None = None):
        self.files = [SafetensorsFile(f, mmap=mmap) for f in files]
        self.tensors = {}
        for f in self.files:
            for name, t in f.tensors.items():
                if name in self.tensors:
                    self.close()
                    raise FormatError(f"tensor {name!r} appears in two shards", path=f.source.name,
                                      field=f"header[{name!r}]", offset=8)
                self.tensors[name] = t

    def sorted_names(self):
        return sorted(self.tensors, key=lambda n: n.encode("utf-8"))

    def close(self):
        for f in self.files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shard_names(wm, idx):
    shards = []
    for v in wm.values():
        if not isinstance(v, str) or os.path.basename(v) != v or v in ("", ".", ".."):
            raise FormatError("shard names must be plain file names", path=idx, field="weight_map", got=v)
        if v not in shards:
            shards.append(v)
    return sorted(shards)


def _open_remote_checkpoint(url: str, mmap: bool | None) -> Checkpoint:
    """A URL naming a ``.safetensors`` file, or a "directory" URL under which ``model.safetensors`` or
    ``model.safetensors.index.json`` (and its shards) can be fetched (no listing needed)."""
    from mcf.remote import RemoteFile

    if url.endswith(".safetensors"):
        return Checkpoint([url], mmap=mmap)
    base = url.rstrip("/")
    idx = base + "/model.safetensors.index.json"
    try:
        with RemoteFile(idx) as f:
            if f.size > MAX_HEADER:
                raise FormatError("shard index too large", path=idx, expected=f"<= {MAX_HEADER} bytes", got=f.size)
            raw = f.read()
    except FileNotFoundError:
        return Checkpoint([base + "/model.safetensors"], mmap=mmap)
    try:
        wm = json.loads(raw).get("weight_map", {})
    except (ValueError, AttributeError) as exc:
        raise FormatError(f"bad shard index: {exc}", path=idx, field="weight_map") from None
    if not isinstance(wm, dict):
        raise FormatError("weight_map must be an object", path=idx, field="weight_map")
    return Checkpoint([base + "/" + s for s in _shard_names(wm, idx)], mmap=mmap)


def open_checkpoint(path, *, mmap: bool | None = None) -> Checkpoint:
    """Open a safetensors file, or a directory holding one or an index of shards (a URL of either too:
    see :mod:`mcf.remote`).  ``mmap=None`` maps files on a local disk and reads them with positional
    reads on a network or FUSE filesystem; ``mmap=True``/``False`` decides instead."""
    from mcf.remote import is_url

    if is_url(path):
        return _open_remote_checkpoint(os.fsdecode(path), mmap)
    path = os.fspath(path)
    if os.path.isdir(path):
        idx = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(single):
            return Checkpoint([single], mmap=mmap)
        if os.path.exists(idx):
            with open(idx, "rb") as f:
                try:
                    wm = json.load(f).get("weight_map", {})
                except (ValueError, AttributeError) as exc:
                    raise FormatError(f"bad shard index: {exc}", path=idx, field="weight_map") from None
            shards = []
            for v in wm.values():
                if not isinstance(v, str) or os.path.basename(v) != v:
                    raise FormatError("shard names must be plain file names", path=idx,
                                      field="weight_map", got=v)
                if v not in shards:
                    shards.append(v)
            return Checkpoint([os.path.join(path, s) for s in sorted(shards)], mmap=mmap)
        cands = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not cands:
            import errno

            raise MissingFileError(errno.ENOENT, "no model.safetensors, shard index or *.safetensors", path)
        return Checkpoint([os.path.join(path, c) for c in cands], mmap=mmap)
    return Checkpoint([path], mmap=mmap)
