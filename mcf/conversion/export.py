"""Exporting MCF files to safetensors: one file, or a Hugging Face checkpoint directory.

The safetensors files are written here, streaming, without the safetensors package: an 8-byte
little-endian header length, a JSON header (``__metadata__`` first, then every tensor's ``dtype``,
``shape`` and ``data_offsets`` in file order) padded with spaces to a multiple of 8, then the tensors
back to back.  Tensors are ordered by decreasing item size, then by name, as the safetensors library
orders them, so each starts aligned to its own item size.

Plain tensors are copied bit for bit (or cast to ``dtype``); quantized ones are decoded row block by
row block straight into the write buffer.  ``dtype="raw"`` keeps a quantized payload as it is, as a
``U8`` tensor of its bytes, and records how to read it in ``__metadata__``: the key ``mcf.quant.<name>``
holds the JSON ``{"method", "shape", "domain", "min_clip", "max_clip"}`` (clips only when the file had
a QuantInfo record).  :func:`mcf.conversion.checkpoint.convert` reads such a file back into the same quantized
tensors.

The block-scaled extensions have a safetensors form of their own, which is what they are written as by
default: their regions become the tensors their convention names (:mod:`mcf.safetensors.conventions`), byte
for byte, so ``mcf pack`` followed by ``mcf export`` gives back the checkpoint's tensors: mxfp4 ``W`` as U8
``W_blocks`` [..., cols/32, 16] and U8 ``W_scales`` [..., cols/32] (gpt-oss); f8_e4m3_b128 ``W`` as F8_E4M3
``W`` and F32 ``W_scale_inv`` (DeepSeek); nvfp4 ``W`` as U8 ``W`` [..., cols/2], F8_E4M3 ``W_scale``
[..., cols/16] and F32 ``W_scale_2`` [] (ModelOpt).  FP8, E8M0 and F4 tensors are copied as F8_*, F4.

A checkpoint directory is published so that no state in between loads as a model: a sharded export
that dies (Ctrl-C, a full disk, a tensor that fails to decode) must not leave its new shards beside an
old index (they would load as one mixed model) nor shards without their index (a model with tensors
missing).  Every weight file is first written complete under a hidden temporary name
(:func:`mcf._core.fs.write_temp`) while the old export stays as it was; a failure there removes the
temporaries and leaves the old export.  Then, in a few renames: one ``model.safetensors`` is renamed over
the old one (a loader prefers it to anything else) before the old index and shards are removed; shards
replace an old export by removing its files, index first (its complete shards still load as the old
model), then renaming the new shards in and writing the index last.  The loader refuses shards named
``model-0000k-of-0000n.safetensors`` with some missing and no index (:func:`mcf.safetensors.open_checkpoint`),
so a crash inside those renames leaves the old model, the new one whole, or a clear error.  A process
killed outright leaves its hidden ``.model-*.safetensors.*.tmp`` temporaries, which no loader reads.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re

import numpy as np

from mcf._core.fs import fsync_dir, write_all, write_atomic, write_temp
from mcf._core._io import alloc_buffer
from mcf.safetensors.reader import ST_DTYPES
from mcf._core.dtypes import DType, DTypeInfo, dtype_info, parse_dtype
from mcf.container.reader import open as open_container
from mcf.errors import InvalidArgumentError, TruncatedError, os_error
from mcf.container.writer import cast_chunk

__all__ = ["export", "parse_size", "RAW_KEY_PREFIX", "DTYPES"]

DTYPES = (None, "f32", "f16", "bf16", "raw")
RAW_KEY_PREFIX = "mcf.quant."
ST_NAMES = {code: name for name, code in ST_DTYPES.items()}
_CHUNK_BYTES = 1 << 20   # bytes read, cast or decoded per step: small enough to stay in the CPU cache
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def parse_size(value) -> int:
    """``5000000000``, ``"5GB"``, ``"500MiB"``, ``"2G"`` -> bytes (decimal units for B/KB/MB/GB/TB,
    binary for KiB/MiB/GiB/TiB, as huggingface_hub reads ``max_shard_size``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", str(value), flags=re.I)
        if not m:
            raise InvalidArgumentError(f"cannot read {value!r} as a size (e.g. 5GB, 500MiB, 1000000)")
        unit = m.group(2).lower().rstrip("b")
        mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}.get(unit)
        if mult is None:
            raise InvalidArgumentError(f"unknown size unit in {value!r}")
        n = int(float(m.group(1)) * mult)
    if n <= 0:
        raise InvalidArgumentError(f"size must be positive, got {value!r}")
    return n


class _Entry:
    __slots__ = ("name", "kind", "out", "shape", "nbytes", "meta", "src", "at")

    def __init__(self, name, kind, out: DTypeInfo, shape, nbytes, meta=None, src=None, at=0):
        self.name, self.kind, self.out, self.shape, self.nbytes, self.meta = name, kind, out, shape, nbytes, meta
        self.src, self.at = src if src is not None else name, at   # the MCF tensor, and where in it the bytes start


#: the tensors a block-scaled weight ``W`` is written as: (region, name suffix, safetensors dtype, shape of it)
_PARTS = {
    "mxfp4": (("data", "_blocks", DType.U8, lambda s: s[:-1] + (s[-1] // 32, 16)),
              ("scales", "_scales", DType.U8, lambda s: s[:-1] + (s[-1] // 32,))),
    "fp8block": (("data", "", DType.F8_E4M3, lambda s: s),
                 ("scales", "_scale_inv", DType.F32, lambda s: (-(-s[0] // 128), -(-s[1] // 128)))),
    "nvfp4": (("data", "", DType.U8, lambda s: s[:-1] + (s[-1] // 2,)),
              ("scales", "_scale", DType.F8_E4M3, lambda s: s[:-1] + (s[-1] // 16,)),
              ("scale", "_scale_2", DType.F32, lambda s: ())),
}


def _scaled_parts(c, name, t) -> list:
    """The entries of block-scaled weight ``name``: its convention's tensors, each one region of the payload."""
    starts = {r.name: (r.offset, r.size) for r in c.quant_layout(name).regions}
    out = []
    for region, suffix, code, shape_of in _PARTS[t.dtype.family]:
        off, size = starts[region]
        out.append(_Entry(name + suffix, "copy", dtype_info(code), tuple(shape_of(tuple(t.shape))), size, src=name,
                          at=off))
    return out


def _plan(c, dtype) -> list:
    """What each tensor becomes: ("copy" | "cast" | "dequant" | "raw", output dtype, shape, bytes)."""
    want = None if dtype in (None, "raw") else parse_dtype(dtype)
    u8 = dtype_info(DType.U8)
    out = []
    for name in c:
        t = c.info(name)
        if name == "__metadata__":
            raise InvalidArgumentError(f"{c.path}: a tensor named '__metadata__' cannot be stored in safetensors "
                                       "(the name is the header's metadata key)")
        if t.dtype.scaled and dtype is None:
            out.extend(_scaled_parts(c, name, t))
        elif t.dtype.quantized:
            if dtype == "raw":
                rec = c.quant_record(name)
                meta = {"method": t.dtype.name, "shape": list(t.shape), "domain": rec.domain if rec else 0}
                if rec is not None:
                    meta.update(min_clip=rec.min_clip, max_clip=rec.max_clip)
                out.append(_Entry(name, "raw", u8, (t.nbytes,), t.nbytes, meta))
            else:
                o = want or dtype_info(DType.F32)
                out.append(_Entry(name, "dequant", o, t.shape, math.prod(t.shape) * o.itemsize))
        elif want is not None and t.dtype.family == "float" and want.code != t.dtype.code:
            n = 1
            for d in t.shape:
                n *= d
            out.append(_Entry(name, "cast", want, t.shape, n * want.itemsize))
        else:
            out.append(_Entry(name, "copy", t.dtype, t.shape, t.nbytes))
    seen = {}
    for e in out:   # a block-scaled weight's parts take names of their own (W_scales, W_scale_inv...)
        first = seen.setdefault(e.name, e.src)
        if first != e.src:
            weight = e.src if e.src != e.name else first
            raise InvalidArgumentError(f"{c.path}: two tensors would be named {e.name!r} in safetensors: a tensor of "
                                       f"the file and a part of the block-scaled weight {weight!r}")
    # as the safetensors library lays files out: larger items first, so every tensor is aligned
    out.sort(key=lambda e: (-e.out.itemsize, e.name.encode("utf-8")))
    return out


def _header(entries) -> bytes:
    meta = {"format": "pt"}
    for e in entries:
        if e.meta is not None:
            meta[RAW_KEY_PREFIX + e.name] = json.dumps(e.meta, separators=(",", ":"))
    hdr = {"__metadata__": meta}
    pos = 0
    for e in entries:
        hdr[e.name] = {"dtype": ST_NAMES[e.out.code], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(hdr, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _chunks(c, e: _Entry, buf):
    """The output bytes of one tensor, in pieces of at most ``buf.nbytes`` (one row block for decoded
    tensors, at least one row).  Stored bytes are read with ``pread`` into ``buf`` (see
    :func:`mcf.conversion.pack._stream_plain` for why not through the mapping)."""
    t = c.info(e.src)
    src = c.source
    if e.kind in ("copy", "raw", "cast"):
        stored = t.nbytes if e.kind == "cast" else e.nbytes   # (a block-scaled weight's part: one region of it)
        isz = max(1, t.dtype.itemsize if e.kind == "cast" else e.out.itemsize)
        step = max(isz, buf.nbytes // isz * isz)
        for o in range(0, stored, step):
            n = min(step, stored - o)
            chunk = buf[:n]
            src.read_ranges((t.offset + e.at + o,), (n,), chunk, (0,))
            if e.kind == "cast":
                chunk = cast_chunk(chunk.view(t.dtype.numpy), t.dtype, e.out)  # quiet: overflow is infinity
            yield chunk
        return
    rows = t.shape[0]
    row_bytes = math.prod(t.shape[1:]) * e.out.itemsize   # (an mxfp4 expert stack: one expert per row)
    step = max(1, buf.nbytes // max(1, row_bytes))
    if row_bytes > buf.nbytes:  # one row does not fit: a buffer of one row, reused for every row
        buf = alloc_buffer(row_bytes)
    store = np.uint16 if e.out.code == DType.BF16 else e.out.numpy
    for r in range(0, rows, step):
        k = min(step, rows - r)
        dst = buf[:k * row_bytes].view(store)
        c.dequantize(e.name, rows=(r, r + k), out=dst)
        yield dst
    if src.is_mapped:  # the decoder read the payload through the mapping: give those pages back
        src.advise("dontneed", t.offset, t.nbytes)


def _copy_range(src_fd: int, dst_fd: int, offset: int, n: int, name: str) -> bool:
    """Copy ``n`` bytes at ``offset`` of ``src_fd`` to the position of ``dst_fd`` inside the kernel
    (``copy_file_range``: no user-space copy, as ``shutil.copyfile`` does).  False when the kernel or
    the file systems cannot, before any byte moved; the caller then copies through user space."""
    done = 0
    while done < n:
        try:
            k = os.copy_file_range(src_fd, dst_fd, n - done, offset + done)
        except OSError as exc:
            if done == 0 and exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                           errno.EBADF, errno.EPERM):
                return False
            raise
        if k == 0:
            raise TruncatedError("file shrank while exporting", path=name, offset=offset + done,
                                 expected=f"{n} bytes",
                                 got=f"{done} bytes")
        done += k
    return True


def _write_safetensors(path, c, entries, buf, progress, done_before, total, *, stage: bool = False):
    """Write ``entries`` of ``c`` as the safetensors file ``path`` through a temporary file: renamed
    into place, or with ``stage`` left complete under its temporary name, which is returned (the
    caller publishes it)."""
    src = c.source
    in_fd = src.fileno() if src.mode in ("mmap", "pread") else None
    use_cfr = [in_fd is not None and hasattr(os, "copy_file_range")]

    def write(fd):
        write_all(fd, _header(entries))
        for i, e in enumerate(entries):
            t = c.info(e.src)
            copied = False
            if e.kind in ("copy", "raw") and use_cfr[0]:
                copied = use_cfr[0] = _copy_range(in_fd, fd, t.offset + e.at, e.nbytes, src.name)
            if not copied:
                n = 0
                for chunk in _chunks(c, e, buf):
                    write_all(fd, chunk)
                    n += chunk.nbytes
                if n != e.nbytes:  # pragma: no cover - the plan and the readers agree by construction
                    raise AssertionError(f"{e.name}: wrote {n} bytes, planned {e.nbytes}")
            if progress is not None:
                progress(done_before + i + 1, total, e.name)

    if stage:
        return write_temp(path, write)
    write_atomic(path, write)  # the directory is fsynced once, after the last file
    return path


def _shards(entries, max_shard_size):
    """Greedy split in file order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_size is None:
        return [entries]
    out, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > max_shard_size:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur or not out:
        out.append(cur)
    return out


def export(src, dst, *, dtype: str | None = None, resources: bool = True, max_shard_size=None, progress=None,
           mmap: bool | None = None) -> list:
    """Write the tensors of MCF file ``src`` as safetensors; returns the paths written.

    ``dst`` ending in ``.safetensors`` is one file.  Anything else is a checkpoint directory (created
    if missing): ``model.safetensors``, or above ``max_shard_size`` (bytes or "5GB") shards
    ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, plus the resource
    sections back under their file names (config.json, tokenizer.json, tokenizer_config.json, ...)
    unless ``resources=False``.  Weight files of an earlier export that would contradict the new one
    (a ``model.safetensors`` next to a new index, stale shards, an old index) are removed.

    ``dtype``: None keeps plain tensors bit for bit, writes block-scaled weights (mxfp4, nvfp4, f8_e4m3_b128)
    as the tensors of their checkpoint convention, byte for byte, and decodes the other quantized ones to F32;
    "f32", "f16", "bf16" make every float tensor that dtype (quantized ones decoded to it, plain ones cast with
    round-to-nearest-even; FP8 and F4 tensors are copied); "raw" keeps quantized payloads as U8 tensors
    described in ``__metadata__`` (see the module docs).  Integer tensors are always copied.  Each file is written
    to a temporary name and renamed, so a failure leaves no partial file; in a directory the weight files are
    all written before any is renamed, and published in an order that never lets a loader see a mix of an
    old export and the new one, or a part of either (see the module docs): an export that fails or is
    interrupted leaves the old checkpoint, the new one whole, or a directory that fails to load naming what
    is missing.
    """
    if dtype is not None:
        dtype = str(dtype).strip().lower()
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    from mcf.remote import refuse_url

    dst = os.fspath(dst)
    refuse_url(dst, what="exporting")  # else "https://h/x" would become a local directory "https:/h/x"
    as_file = dst.endswith(".safetensors")
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    if as_file and limit is not None:
        raise InvalidArgumentError("max_shard_size needs a directory destination, not a .safetensors file")
    if not as_file and os.path.exists(dst) and not os.path.isdir(dst):
        raise InvalidArgumentError(f"{dst} exists and is not a directory (end the name with .safetensors "
                                   "to write one file)")
    with open_container(src, mmap=mmap) as c:
        entries = _plan(c, dtype)
        buf = alloc_buffer(_CHUNK_BYTES)
        if as_file:
            _write_safetensors(dst, c, entries, buf, progress, 0, len(entries))
            return [dst]
        try:
            os.makedirs(dst, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, dst) from None
        groups = _shards(entries, limit)
        if len(groups) == 1:
            names = [_SINGLE]
        else:
            names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
        staged = []  # (temporary, final path) of each weight file, complete and fsynced
        try:
            done = 0
            for fname, group in zip(names, groups):
                path = os.path.join(dst, fname)
                staged.append((_write_safetensors(path, c, group, buf, progress, done, len(entries), stage=True),
                               path))
                done += len(group)
            index = None
            if len(groups) > 1:
                wm = {e.name: fname for fname, group in zip(names, groups) for e in group}
                doc = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                       "weight_map": dict(sorted(wm.items()))}
                index = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
            written = _publish_weights(dst, staged, index)
        finally:
            for tmp, _ in staged:  # left only when the export failed before renaming them
                if os.path.lexists(tmp):
                    os.unlink(tmp)
        if resources:
            for fname, data in c.resources.items():
                path = os.path.join(dst, fname)
                write_atomic(path, lambda fd, data=data: write_all(fd, data))
                written.append(path)
        fsync_dir(dst)
    return written


def _weight_files(directory: str) -> list:
    """The names of the weight files in ``directory`` a loader reads (model.safetensors, the shard
    index, shards), the index first and the shards last: the order :func:`_publish_weights` removes
    them in."""
    rank = {_INDEX: 0, _SINGLE: 1}
    return sorted((n for n in os.listdir(directory) if n in rank or _SHARD_RE.fullmatch(n)),
                  key=lambda n: (rank.get(n, 2), n))


def _publish_weights(dst: str, staged: list, index: bytes | None) -> list:
    """Put the complete temporary weight files ``staged`` ((temporary, final path) pairs) in place of
    the weight files ``dst`` holds, so that a loader never sees a mix of the two exports nor a part of
    one, whenever the process dies (see the module docstring); returns the paths written.

    One file (``model.safetensors``): renamed over the old one, which a loader prefers to anything else,
    so the old export is read until the rename and the new one after; then the old index and shards go.
    Shards: the old weight files go first (the index first, so the old shards, complete, still load as
    the old model; then the shards), then the new shards are renamed in and the index written last.  A
    set of ``model-0000k-of-0000n`` shards with some missing and no index is refused by the loader
    (:func:`mcf.safetensors.open_checkpoint`), so the states in between load the old model, the new one
    complete, or fail naming what is missing."""
    if index is None:
        (tmp, path), = staged
        _rename(tmp, path)
        for name in _weight_files(dst):
            if name != _SINGLE:
                _unlink(os.path.join(dst, name))
        return [path]
    for name in _weight_files(dst):
        _unlink(os.path.join(dst, name))
    fsync_dir(dst)  # the old files are gone (durably) before any new one appears
    for tmp, path in staged:
        _rename(tmp, path)
    fsync_dir(dst)  # every shard is in place (durably) before the index names them
    path = os.path.join(dst, _INDEX)
    write_atomic(path, lambda fd: write_all(fd, index))
    return [p for _, p in staged] + [path]


def _rename(tmp: str, path: str) -> None:
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise os_error(exc, path) from None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise os_error(exc, path) from None
