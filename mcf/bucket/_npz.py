"""Reading the ``.npz`` archive of an ingest (arrays ``k`` and ``v``, each ``[layers, kv_heads, tokens,
head_dim]``) from someone who may be hostile, with memory bounded by a constant.

``numpy.load`` trusts an archive: a 2 MiB ``.npz`` whose two members are deflate streams declaring 1 GiB
each is read into 2 GiB of arrays before anything can refuse it, a central directory of millions of
entries is parsed into millions of objects, and a complex, bool or string array is happily cast to
float later.  Here every declared size is checked before the data it describes is read:

1. the end-of-central-directory record (zip64 too) is read first: at most :data:`MAX_MEMBERS` entries
   and a central directory of at most :data:`MAX_DIRECTORY_BYTES`, else nothing else is parsed;
2. the members must be exactly ``k.npy`` and ``v.npy``, stored or deflated, not encrypted;
3. each member's ``.npy`` header (at most 10,000 bytes, numpy's own cap) gives dtype, shape and order:
   floating point or integer only, four dimensions, ``k`` and ``v`` alike, and the member's declared
   size must be exactly header + data;
4. the two arrays' declared bytes together count against ``limit`` (the upload limit, so a small
   compressed body cannot expand past what an uncompressed one may be): :class:`UploadTooLargeError`;
5. only then is data touched, and never into memory sized by the archive: a stored member is checked
   (bounds, then its CRC-32 in a streaming pass) and mapped read-only where it lies in the file; a
   deflated member is decompressed, in pieces, into a scratch file (zipfile stops at the declared size
   and checks the CRC-32) that is then mapped.  A refused archive has allocated nothing of its size.

The arrays handed out are read-only maps of those files, valid after :meth:`NpzArrays.close` (a
mapping keeps its file alive).
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from mcf._core.lifetime import ClosedOnExit
from mcf.errors import FormatError, InvalidArgumentError

__all__ = ["MAX_DIRECTORY_BYTES", "MAX_MEMBERS", "NpzArrays", "UploadTooLargeError", "read_kv_npz"]

#: more entries than an archive of k and v has; a larger central directory is refused unparsed
MAX_MEMBERS = 8
MAX_DIRECTORY_BYTES = 64 << 10
MEMBERS = ("k.npy", "v.npy")
_PIECE = 1 << 20
_EOCD = struct.Struct("<4sHHHHIIH")            # end of central directory (22 bytes)
_ZIP64_LOCATOR = struct.Struct("<4sIQI")        # 20 bytes, right before the EOCD
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")     # 56 bytes
_LOCAL = struct.Struct("<4sHHHHHIIIHH")         # local file header (30 bytes)


class UploadTooLargeError(InvalidArgumentError):
    """The body, or the arrays it declares, exceed the upload limit (HTTP 413)."""


class NpzArrays(ClosedOnExit):
    """``k`` and ``v`` as read-only arrays mapped from the archive (or its scratch files)."""

    def __init__(self, k: np.ndarray, v: np.ndarray, files: list[BinaryIO]) -> None:
        self.k, self.v, self._files = k, v, files

    def layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per-layer (K, V) views, as :meth:`mcf.bucket.Bucket.ingest` takes them."""
        return [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


def _bad(reason: str, name: Any, **kw: Any) -> FormatError:
    return FormatError(reason, path=name, **kw)


def _check_directory(f: BinaryIO, size: int, name: Any) -> None:
    """Refuse archives whose central directory is too large or too long, before zipfile parses it."""
    tail_len = min(size, _EOCD.size + 0xFFFF)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    pos = len(tail)
    while True:  # the last signature whose record (and comment) ends exactly at the end of the archive
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
        if pos < 0 or (pos + _EOCD.size <= len(tail)
                       and pos + _EOCD.size + _EOCD.unpack_from(tail, pos)[7] == len(tail)):
            break
    if pos < 0:
        raise _bad("not a zip archive (.npz): no end-of-central-directory record", name)
    _, _, _, _, count, cd_size, _, _ = _EOCD.unpack_from(tail, pos)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF:
        lpos = pos - _ZIP64_LOCATOR.size
        if lpos < 0 or tail[lpos:lpos + 4] != b"PK\x06\x07":
            raise _bad("zip64 end-of-central-directory locator missing", name)
        z64_off = _ZIP64_LOCATOR.unpack_from(tail, lpos)[2]
        if z64_off + _ZIP64_EOCD.size > size:
            raise _bad("zip64 end-of-central-directory record outside the archive", name)
        f.seek(z64_off)
        rec = f.read(_ZIP64_EOCD.size)
        if len(rec) != _ZIP64_EOCD.size or rec[:4] != b"PK\x06\x06":
            raise _bad("bad zip64 end-of-central-directory record", name, offset=z64_off)
        count, cd_size = _ZIP64_EOCD.unpack(rec)[7:9]
    if count > MAX_MEMBERS or cd_size > MAX_DIRECTORY_BYTES:
        raise _bad(f"archive directory of {count} entries and {cd_size} bytes; an ingest body holds k.npy and "
                   f"v.npy (at most {MAX_MEMBERS} entries, {MAX_DIRECTORY_BYTES} bytes)", name)


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: Any) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, header length) of one member's .npy header, checked."""
    fmt = np.lib.format
    with zf.open(info) as m:
        try:
            version = fmt.read_magic(m)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(m)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(m)
            else:  # 3.0 exists only for structured dtypes with non-latin-1 field names
                raise FormatError(f"unsupported .npy version {version[0]}.{version[1]}")
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError, OverflowError) as exc:
            raise _bad(f"{info.filename}: not a readable .npy header ({exc})", name, field=info.filename) from None
        hlen = m.tell()
    if dtype.kind not in "fiu" or dtype.subdtype is not None:
        raise _bad(f"{info.filename}: dtype {dtype} is not allowed: k and v must be floating point or integer "
                   "arrays (complex, bool, datetime, string, object and structured arrays are refused)", name,
                   field=info.filename)
    if len(shape) != 4 or any(d < 0 for d in shape):
        raise _bad(f"{info.filename}: expected [layers, kv_heads, tokens, head_dim], got shape {shape}", name,
                   field=info.filename)
    return shape, fortran, dtype, hlen


def _mapped(f: BinaryIO, offset: int, dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> np.ndarray:
    if math.prod(shape) == 0:
        a = np.empty(shape, dtype, order="F" if fortran else "C")
        a.flags.writeable = False
        return a
    return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def read_kv_npz(f: BinaryIO, *, limit: int | None, scratch: Callable[[], BinaryIO] | None = None,
                name: Any = None) -> NpzArrays:
    """Check and map the ``k`` and ``v`` arrays of the ``.npz`` archive in the seekable binary file
    ``f`` (see the module docstring).  ``limit`` bounds the two arrays' declared bytes together
    (None: no bound); ``scratch()`` returns a new empty read-write binary file for a deflated member's
    data (default: an anonymous temporary file).  Raises :class:`UploadTooLargeError` or
    :class:`~mcf.errors.FormatError` (naming ``name``) before allocating anything sized by the archive.
    """
    scratch = scratch or (lambda: tempfile.TemporaryFile())  # noqa: SIM115 - returned to the caller
    size = f.seek(0, os.SEEK_END)
    _check_directory(f, size, name)
    f.seek(0)
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError, struct.error,
            NotImplementedError, RuntimeError) as exc:
        raise _bad(f"not a readable zip archive (.npz): {exc}", name) from None
    opened: list[BinaryIO] = []
    try:
        infos = zf.infolist()
        if sorted(i.filename for i in infos) != list(MEMBERS):
            raise _bad(f"the .npz body must hold exactly the arrays 'k' and 'v', got members "
                       f"{sorted(i.filename for i in infos)[:MAX_MEMBERS]}", name)
        heads = {}
        for info in infos:
            if info.flag_bits & 0x61:  # encrypted, patched data, strong encryption
                raise _bad(f"{info.filename}: encrypted or patched zip members are not supported", name,
                           field=info.filename)
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise _bad(f"{info.filename}: compression method {info.compress_type} is not supported (use "
                           "numpy.savez or numpy.savez_compressed)", name, field=info.filename)
            heads[info.filename] = (info, *_header(zf, info, name))
        (_, kshape, _, _, _), (_, vshape, _, _, _) = heads["k.npy"], heads["v.npy"]
        if kshape != vshape:
            raise _bad(f"k and v must have the same shape, got {kshape} and {vshape}", name)
        nbytes = {n: math.prod(h[1]) * h[3].itemsize for n, h in heads.items()}
        if limit is not None and sum(nbytes.values()) > limit:
            raise UploadTooLargeError(f"the arrays k and v declare {sum(nbytes.values())} bytes, more than the "
                                      f"upload limit of {limit} bytes")
        for n, (info, _, _, _, hlen) in heads.items():
            if info.file_size != hlen + nbytes[n]:
                raise _bad(f"{n}: the archive declares {info.file_size} bytes, its .npy header {hlen + nbytes[n]}",
                           name, field=n)
        arrays = {}
        for n, (info, shape, fortran, dtype, hlen) in heads.items():
            if info.compress_type == zipfile.ZIP_STORED:
                arrays[n] = _map_stored(f, zf, info, size, hlen, dtype, shape, fortran, name)
            else:
                arrays[n] = _map_deflated(zf, info, hlen, nbytes[n], dtype, shape, fortran, scratch, opened, name)
        return NpzArrays(arrays["k.npy"], arrays["v.npy"], opened)
    except (zipfile.BadZipFile, EOFError, zlib.error, struct.error, OSError, ValueError, NotImplementedError,
            RuntimeError) as exc:
        for g in opened:
            g.close()
        if isinstance(exc, (FormatError, InvalidArgumentError)):
            raise
        raise _bad(f"damaged .npz archive: {exc}", name) from None
    except BaseException:
        for g in opened:
            g.close()
        raise
    finally:
        zf.close()


def _drain(zf: zipfile.ZipFile, info: zipfile.ZipInfo, sink: Callable[[bytes], None] | None = None,
           skip: int = 0) -> int:
    """Read a member to its end in pieces (zipfile checks its CRC-32 there), handing the bytes after the
    first ``skip`` to ``sink``; returns how many it handed over."""
    n = 0
    with zf.open(info) as m:
        m.read(skip)
        while piece := m.read(_PIECE):
            n += len(piece)
            if sink is not None:
                sink(piece)
    return n


def _map_stored(f, zf, info, size, hlen, dtype, shape, fortran, name) -> np.ndarray:
    f.seek(info.header_offset)
    local = f.read(_LOCAL.size)
    if len(local) != _LOCAL.size or local[:4] != b"PK\x03\x04":
        raise _bad(f"{info.filename}: bad local header", name, field=info.filename, offset=info.header_offset)
    fields = _LOCAL.unpack(local)
    start = info.header_offset + _LOCAL.size + fields[9] + fields[10]
    if info.compress_size != info.file_size or start + info.compress_size > size:
        raise _bad(f"{info.filename}: stored data extends past the end of the archive", name, field=info.filename,
                   offset=start)
    _drain(zf, info)  # CRC-32 of the stored bytes, read in pieces: nothing mapped before it matches
    return _mapped(f, start + hlen, dtype, shape, fortran)


def _map_deflated(zf, info, hlen, nbytes, dtype, shape, fortran, scratch, opened, name) -> np.ndarray:
    out = scratch()
    opened.append(out)
    got = _drain(zf, info, out.write, skip=hlen)
    if got != nbytes:
        raise _bad(f"{info.filename}: {got} bytes of array data, its header declares {nbytes}", name,
                   field=info.filename)
    out.flush()
    return _mapped(out, 0, dtype, shape, fortran)
