"""A validating safetensors reader over the I/O core (no dependency on the safetensors package).

Layout: ``u64 header_len | JSON header (header_len bytes) | data``.  The header maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data start, plus an optional
``__metadata__`` of strings.  Checks follow the safetensors library's own: header size cap, integer
fields, offsets inside the data, ``end - begin`` equal to the bits of the dtype and shape in whole
bytes, no overlaps.  Every dtype safetensors defines is read (:mod:`mcf.loading.dtypes`); those MCF
cannot store (BOOL, F6, C64) are refused by the converters, not here.

A sharded checkpoint (``model.safetensors.index.json``) is checked against its shards before anything
is read: every tensor the index lists must be in the shard it names, every shard tensor must be
listed, no tensor may be in two shards, and a shard the index names must exist.

Which files a path or URL means is decided once, by :func:`locate_checkpoint`, for every transport and
every caller (the loaders, ``mcf info``, ``mcf pack`` and ``mcf convert``), with the rule transformers
follows: a directory is its ``model.safetensors`` if it has one, else its ``model.safetensors.index.json``
and the shards it lists, else (a local directory, which can be listed) its ``*.safetensors`` files.  A
URL is a file, an index or a directory by the path of the URL (its query and fragment left out), and a
directory URL is probed by name, no listing needed: a store that answers 403 for a missing key (S3
without ListBucket, CloudFront) is taken as answering 404.
"""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import re
import struct
from dataclasses import dataclass

from mcf.io import Source, open_source
from mcf._core.fs import read_regular
from mcf._core.dtypes import DTypeInfo, dtype_info
from mcf._core.memory import allocating
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import AccessError, FormatError, MissingFileError, TruncatedError, os_error
from mcf.loading.dtypes import ELEMENTS, Element, element
from mcf.remote import is_url, redact
from mcf.remote._urls import join_path, split_url, url_name

__all__ = ["SafetensorsFile", "SafetensorsTensor", "Checkpoint", "CheckpointFiles", "open_checkpoint",
           "locate_checkpoint", "name_kind", "url_name", "join_name", "ST_DTYPES", "INDEX_NAME", "WEIGHTS_NAME"]

MAX_HEADER = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"

#: safetensors dtype name -> the MCF dtype of the same bits, for those MCF can store (what ``mcf pack``
#: and ``mcf export`` map between).
ST_DTYPES = {e.name: e.mcf for e in ELEMENTS.values() if e.mcf is not None}


@dataclass(frozen=True, slots=True)
class SafetensorsTensor:
    """One tensor of a safetensors file: ``element`` is its safetensors dtype, ``dtype`` the MCF dtype of
    the same bits (None when MCF has none: BOOL, F6, C64)."""

    name: str
    dtype: DTypeInfo | None
    shape: tuple
    offset: int     # absolute offset in the file
    nbytes: int
    file: "SafetensorsFile"
    element: Element

    def array(self):
        """Zero-copy (when mapped) numpy view of the tensor (bfloat16 and float8 as ml_dtypes types when
        installed, else their raw bits; see :mod:`mcf.loading.dtypes`)."""
        from mcf.loading.dtypes import numpy_dtype

        dt = numpy_dtype(self.element, f"{self.file.source.name}: tensor {self.name!r}")
        src = self.file.source
        with allocating(self.nbytes, src.name, self.name, source=src):
            return src.array(self.offset, dt, self.shape)


class SafetensorsFile(ClosedOnExit):
    """One ``.safetensors`` file (a path, URL, buffer, file-like or :class:`mcf.io.Source`), its header
    validated when opened: ``tensors`` (name -> :class:`SafetensorsTensor`) and ``metadata``."""

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
        collect = gc.isenabled()
        gc.disable()   # millions of new objects, none in a cycle: the collections they set off were most of the time
        try:
            header = _load_header(src, hlen)
            return self._check_header(header, 8 + hlen)
        finally:
            if collect:
                gc.enable()

    def _check_header(self, header, data_start: int):
        """(tensors, metadata) of a parsed header (see :func:`_load_header`), every entry checked.  The
        tensors replace the entries in ``header`` itself, which becomes the ``tensors`` mapping: no second
        dict of every name."""
        path = self.source.name
        if type(header) is tuple:
            raise FormatError("header is a single tensor entry, not an object of tensors", path=path,
                              field="header", offset=8)
        if not isinstance(header, dict):
            raise FormatError("header is not a JSON object", path=path, field="header", offset=8)
        data_size = self.source.size - data_start
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise FormatError("__metadata__ must be an object of strings (as safetensors requires)", path=path,
                              field="header['__metadata__']", offset=8,
                              got="dict" if type(meta) is tuple else type(meta).__name__)
        spans = []
        infos = {}   # element -> its MCF dtype, looked up once
        for name, ent in header.items():
            if type(ent) is not tuple:   # not an entry of the usual form: says what is wrong
                _refuse_entry(path, name, ent)
            el, shape, b, e = ent
            if not 0 <= b <= e <= data_size:
                raise TruncatedError("tensor data outside the file", path=path,
                                     field=f"header[{name!r}].data_offsets", offset=8,
                                     expected=f"0 <= begin <= end <= {data_size}", got=[b, e])
            bits = math.prod(shape) * el.bits
            if bits % 8:
                raise FormatError(f"{el.name} values of this shape do not fill whole bytes", path=path,
                                  field=f"header[{name!r}].shape", offset=8, expected="a multiple of 8 bits",
                                  got=f"{bits} bits")
            want = bits // 8
            if e - b != want:
                raise FormatError("data size does not match dtype and shape", path=path,
                                  field=f"header[{name!r}].data_offsets", offset=8, expected=want, got=e - b)
            info = infos.get(el, False)
            if info is False:
                info = infos[el] = dtype_info(el.mcf) if el.mcf is not None else None
            header[name] = SafetensorsTensor(name, info, shape, data_start + b, e - b, self, el)
            if e > b:
                spans.append((b, e, name))
        spans.sort()
        for (_b1, e1, n1), (b2, _e2, n2) in zip(spans, spans[1:]):
            if b2 < e1:
                raise FormatError(f"tensors {n1!r} and {n2!r} overlap", path=path,
                                  field=f"header[{n2!r}].data_offsets", offset=8)
        return header, meta

    def storage_order(self) -> list:
        """Tensor names in the order of their data in the file (what safetensors' ``load_file`` returns;
        empty tensors at one offset, which safetensors orders at random, by name)."""
        return [t.name for t in sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes, t.name))]

    def close(self):
        self.source.close()


def _load_header(src: Source, hlen: int):
    """The JSON header at offset 8 of ``src``, ``hlen`` bytes, parsed with its tensor entries as compact tuples
    (:func:`_compact_entry`), in bounded memory: see docs/reliability.md, "Memory a file can ask for".

    The bytes are decoded to text straight from the source (a mapped file's pages, or one read buffer freed
    at once), as ``json.loads`` decodes bytes (UTF-8, or the UTF-16/32 it detects); only the text and the
    parsed header are alive together."""
    path = src.name
    raw = src.view(8, hlen)
    try:
        text = str(raw, json.detect_encoding(bytes(raw[:4])), "surrogatepass")
        del raw
        shapes = {}   # one tuple per distinct shape: a model's layers share a handful

        def compact(obj):
            return _compact_entry(obj, shapes)

        return json.loads(text, object_hook=compact)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too many digits, too deep
        raise FormatError(f"header is not valid JSON: {exc}", path=path, field="header", offset=8) from None


def _compact_entry(d: dict, shapes: dict):
    """``json.loads``' object hook: a tensor entry of the usual form (``dtype`` a known name, ``shape`` a list
    of non-negative ints, ``data_offsets`` two ints; JSON gives int, never bool, for a number without a
    fraction) becomes ``(element, shape tuple, begin, end)``: a third of the memory of the dict and two
    lists, for headers of millions of tensors; equal shapes share one tuple (``shapes``).  Any other object
    stays the dict ``json.loads`` made, and :func:`_refuse_entry` says what is wrong with it when it is an
    entry."""
    if len(d) < 3:
        return d
    dt, shape, offs = d.get("dtype"), d.get("shape"), d.get("data_offsets")
    el = ELEMENTS.get(dt) if type(dt) is str else None
    if (el is None or type(shape) is not list or type(offs) is not list or len(offs) != 2
            or type(offs[0]) is not int or type(offs[1]) is not int
            or not all(type(n) is int and n >= 0 for n in shape)):
        return d
    shape = tuple(shape)
    return el, shapes.setdefault(shape, shape), offs[0], offs[1]


def _refuse_entry(path, name, ent):
    """The error for a tensor entry of a header that is not ``{"dtype", "shape", "data_offsets"}`` of the
    right types."""
    field = f"header[{name!r}]"
    if not isinstance(ent, dict):
        raise FormatError("tensor entry is not an object", path=path, field=field, offset=8)
    dt, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
    if element(dt) is None:
        raise FormatError("unsupported dtype", path=path, field=field + ".dtype", offset=8,
                          expected="one of " + ",".join(ELEMENTS), got=dt)
    if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in shape)):
        raise FormatError("shape must be a list of non-negative integers", path=path, field=field + ".shape",
                          offset=8, got=shape)
    raise FormatError("data_offsets must be [begin, end]", path=path, field=field + ".data_offsets", offset=8,
                      got=offs)


class Checkpoint(ClosedOnExit):
    """All tensors of a checkpoint: one ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json`` (``index`` and its ``weight_map``, checked against the shards
    here), or every ``*.safetensors`` of a directory.  ``files`` may be paths, URLs or sources; ``shards``
    are the file names the index gives them (by default their base names).  ``index`` is kept as messages
    show it (a URL redacted, :func:`mcf.remote.redact`)."""

    def __init__(self, files: list, *, mmap: bool | None = None, index: str | None = None,
                 weight_map: dict | None = None, shards: list | None = None):
        self.files = []
        self.index = None if index is None else redact(index)
        if shards is None:
            shards = [None] * len(files)
        try:
            shard_of = {}
            for f, shard in zip(files, shards):
                self.files.append(_open_shard(f, mmap, self.index, weight_map, shard))
                if shard is not None:
                    shard_of[id(self.files[-1])] = shard
            self.tensors = {}
            for f in self.files:
                for name, t in f.tensors.items():
                    if name in self.tensors:
                        raise FormatError(f"tensor {name!r} appears in two shards "
                                          f"({self.tensors[name].file.source.name} and {f.source.name})",
                                          path=f.source.name, field=f"header[{name!r}]", offset=8)
                    self.tensors[name] = t
            if weight_map is not None:
                _check_index(self, weight_map, self.index, shard_of)
        except BaseException:
            self.close()
            raise

    @classmethod
    def of_files(cls, files: list) -> "Checkpoint":
        """A checkpoint of already open :class:`SafetensorsFile` objects (closing it closes them)."""
        ck = cls([])
        ck.files = list(files)
        for f in ck.files:
            for name, t in f.tensors.items():
                if name in ck.tensors:
                    raise FormatError(f"tensor {name!r} appears in two shards", path=f.source.name,
                                      field=f"header[{name!r}]", offset=8)
                ck.tensors[name] = t
        return ck

    def sorted_names(self):
        return sorted(self.tensors, key=lambda n: n.encode("utf-8"))

    def storage_order(self) -> list:
        """Tensor names shard by shard (in the order of ``files``), each shard's in the order of its data."""
        return [n for f in self.files for n in f.storage_order()]

    def close(self):
        for f in self.files:
            f.close()


def _open_shard(f, mmap, index, weight_map, shard) -> SafetensorsFile:
    """A shard, with a missing one named by the index that lists it and a tensor it should hold."""
    try:
        return SafetensorsFile(f, mmap=mmap)
    except MissingFileError as exc:
        if index is None or isinstance(f, Source):
            raise
        if shard is None:
            shard = os.path.basename(os.fsdecode(f).rstrip("/"))
        held = [n for n, s in (weight_map or {}).items() if s == shard]
        what = f" (it holds {held[0]!r}" + (f" and {len(held) - 1} more)" if len(held) > 1 else ")") if held else ""
        raise MissingFileError(exc.errno or errno.ENOENT, f"shard listed in {index}{what} is missing",
                               exc.filename) from None


def parse_index(raw: bytes, idx: str) -> dict:
    """``weight_map`` of a shard index: an object of tensor name -> plain file name in the index's
    directory (no path separators, no ``..``, no NUL), not empty.  ``idx`` names the index in errors."""
    idx = redact(idx)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"shard index is not valid JSON: {exc}", path=idx) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise FormatError("shard index needs a non-empty weight_map object", path=idx, field="weight_map",
                          expected="{tensor name: shard file name}", got=type(wm).__name__)
    for name, shard in wm.items():
        if isinstance(shard, str) and "\0" in shard:
            raise FormatError("a shard name holds a NUL character, which no file name can", path=idx,
                              field=f"weight_map[{name!r}]", expected="a plain file name", got=repr(shard))
        if (not isinstance(shard, str) or shard in ("", ".", "..") or os.path.basename(shard) != shard
                or "/" in shard or "\\" in shard):
            raise FormatError("shard names must be plain file names in the index's directory", path=idx,
                              field=f"weight_map[{name!r}]", got=repr(shard))
    return wm


def _check_index(ckpt: Checkpoint, wm: dict, idx: str, shard_of: dict) -> None:
    def shard_name(f):
        return shard_of.get(id(f)) or os.path.basename(f.source.name)

    for name, shard in wm.items():
        t = ckpt.tensors.get(name)
        if t is None or shard_name(t.file) != shard:
            raise FormatError(f"the index puts tensor {name!r} in {shard}, which does not hold it",
                              path=idx, field=f"weight_map[{name!r}]")
    for name, t in ckpt.tensors.items():
        if name not in wm:
            raise FormatError(f"tensor {name!r} of {shard_name(t.file)} is not in the index", path=idx,
                              field="weight_map")


# -- which files a path or URL means -------------------------------------------------------------------------
def name_kind(path) -> str | None:
    """What the name of ``path`` (:func:`url_name`) says it is: ``"file"`` (``*.safetensors``), ``"index"``
    (``*.json``), ``"directory"`` (a trailing ``/``, or a URL naming no path), or None (nothing)."""
    p = url_name(path)
    if is_url(p) and "/" not in p.split("://", 1)[1]:   # scheme://host: its root
        return "directory"
    if p.endswith("/"):
        return "directory"
    if p.endswith(".safetensors"):
        return "file"
    if p.endswith(".json"):
        return "index"
    return None


def join_name(base, name: str) -> str:
    """The path or URL of the file ``name`` in the directory ``base`` (:func:`mcf.remote._urls.join_path`: a
    URL keeps its query, a name is percent-encoded where the scheme has query syntax)."""
    return join_path(base, name)


def _parent(url: str) -> str:
    """The directory URL of the file ``url`` (its query kept)."""
    head, query = split_url(url)
    return head.rsplit("/", 1)[0] + "/" + query


@dataclass(frozen=True)
class CheckpointFiles:
    """What a checkpoint path or URL names (:func:`locate_checkpoint`): the ``files`` to open, in order;
    the shard ``index`` they come from (its path or URL as given), its ``weight_map`` and the file name it
    gives each file (``shards``), all None without an index; ``directory``: the directory (a path or a URL)
    when one was given, else None."""

    files: tuple
    index: str | None = None
    weight_map: dict | None = None
    shards: tuple | None = None
    directory: str | None = None

    def open(self, *, mmap: bool | None = None) -> Checkpoint:
        """The :class:`Checkpoint` of these files, checked against the index when there is one."""
        return Checkpoint(list(self.files), mmap=mmap, index=self.index, weight_map=self.weight_map,
                          shards=None if self.shards is None else list(self.shards))


def locate_checkpoint(path) -> CheckpointFiles:
    """The files a safetensors checkpoint path or URL means, the one rule of every loader and command:

    - a ``*.safetensors`` file (for a URL: its path, query and fragment aside, ends so) is itself;
    - a ``*.json`` file is a shard index: the shards its ``weight_map`` names, in its directory;
    - a directory (for a URL: any other) is its ``model.safetensors`` if it has one, else its
      ``model.safetensors.index.json`` and the shards that lists (transformers' order), else, for a local
      directory, every ``*.safetensors`` in it.  A URL is probed by name (no listing): a 403 counts as a
      404 (a store that may not list answers 403 for a missing key), and when neither file can be had the
      :class:`mcf.MissingFileError` (:class:`mcf.AccessError` if a probe was refused) names both URLs and
      what each answered.

    Nothing is opened but what the decision needs (a probe's size, the index)."""
    p = os.fsdecode(os.fspath(path))
    if is_url(p):
        kind = name_kind(p)
        if kind == "file":
            return CheckpointFiles((p,))
        if kind == "index":
            return _index_files(p, _read_remote(p), None)
        return _remote_directory(p)
    if os.path.isdir(p):
        return _local_directory(p)
    if p.endswith(".json") and os.path.isfile(p):
        return _index_files(p, _read_local(p), None)
    return CheckpointFiles((p,))


def _index_files(idx: str, raw: bytes, directory: str | None) -> CheckpointFiles:
    wm = parse_index(raw, idx)
    base = _parent(idx) if is_url(idx) else os.path.dirname(idx)
    shards = _shards(wm)
    return CheckpointFiles(tuple(join_name(base, s) for s in shards), index=idx, weight_map=wm,
                           shards=tuple(shards), directory=directory)


def _local_directory(d: str) -> CheckpointFiles:
    # exists, not isfile: a FIFO or a directory under the name is that file, refused when it is opened, never
    # passed over for another one
    single = os.path.join(d, WEIGHTS_NAME)
    if os.path.exists(single):
        return CheckpointFiles((single,), directory=d)
    idx = os.path.join(d, INDEX_NAME)
    if os.path.exists(idx):
        return _index_files(idx, _read_local(idx), d)
    try:
        cands = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    except OSError as exc:
        raise os_error(exc, d) from None
    if not cands:
        raise MissingFileError(errno.ENOENT, f"no {WEIGHTS_NAME}, shard index or *.safetensors", d)
    _check_shard_set(d, cands)
    return CheckpointFiles(tuple(os.path.join(d, c) for c in cands), directory=d)


def _remote_directory(url: str) -> CheckpointFiles:
    from mcf.remote import RemoteFile

    refused = []
    for name in (WEIGHTS_NAME, INDEX_NAME):
        probe = join_name(url, name)
        try:
            f = RemoteFile(probe)   # its size: is it there
        except (FileNotFoundError, PermissionError) as exc:   # 404, or 403/401 (a store that may not list)
            refused.append((probe, exc))
            continue
        if name == WEIGHTS_NAME:
            f.close()
            return CheckpointFiles((probe,), directory=url)
        with f:
            raw = _read_index(f, probe)
        return _index_files(probe, raw, url)
    answers = "; ".join(f"{redact(u)}: {getattr(e, 'strerror', None) or e}" for u, e in refused)
    cls = MissingFileError if all(isinstance(e, FileNotFoundError) for _, e in refused) else AccessError
    raise cls(errno.ENOENT if cls is MissingFileError else errno.EACCES,
              f"no safetensors checkpoint under this URL, which names no .safetensors or .json file (probed "
              f"{WEIGHTS_NAME}, then {INDEX_NAME}: {answers})", url)


def _read_index(f, idx: str) -> bytes:
    if f.size > MAX_HEADER:
        raise FormatError("shard index too large", path=idx, expected=f"<= {MAX_HEADER} bytes", got=f.size)
    return f.read()


def _read_remote(idx: str) -> bytes:
    from mcf.remote import RemoteFile

    with RemoteFile(idx) as f:
        return _read_index(f, idx)


def _read_local(idx: str) -> bytes:
    return read_regular(idx, limit=MAX_HEADER, what="shard index")  # a FIFO or a device is refused, never read


def _shards(wm: dict) -> list:
    return sorted(set(wm.values()))


_SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _check_shard_set(directory: str, names: list) -> None:
    """Shards named ``model-0000k-of-0000n.safetensors`` in a directory without an index must be all
    ``n`` of one set: some missing (an interrupted export or download) or two sets side by side would
    load as a model with tensors missing, or a mix of two."""
    sets: dict = {}
    for n in names:
        m = _SHARD_NAME.fullmatch(n)
        if m:
            sets.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    for total, have in sorted(sets.items()):
        missing = [k for k in range(1, total + 1) if k not in have]
        if missing:
            raise MissingFileError(errno.ENOENT, f"shards without {INDEX_NAME}, and model-{missing[0]:05d}-of-"
                                   f"{total:05d}.safetensors is missing (an interrupted export or download?)",
                                   directory)
    if len(sets) > 1:
        raise FormatError(f"shards of {len(sets)} checkpoints side by side ("
                          + ", ".join(f"model-*-of-{t:05d}" for t in sorted(sets)) + f") and no {INDEX_NAME}",
                          path=directory)


def open_checkpoint(path, *, mmap: bool | None = None) -> Checkpoint:
    """Open a safetensors file, a ``model.safetensors.index.json`` and its shards, or a directory
    holding ``model.safetensors``, an index, or else ``*.safetensors`` files (a URL of any of these too:
    see :mod:`mcf.remote`); which files, :func:`locate_checkpoint` decides.  Sharded checkpoints are
    checked against their index.  ``mmap=None`` maps files on a local disk and reads them with positional
    reads on a network or FUSE filesystem; ``mmap=True``/``False`` decides instead."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return Checkpoint([path], mmap=mmap)   # a buffer, file-like object or Source
    return locate_checkpoint(path).open(mmap=mmap)
