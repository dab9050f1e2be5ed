"""Writing and reading ``kv_data.mcb``: one context's KV cache (layout in :mod:`mcf.bucket._layout`).

Why chunks: a compressed cache stored as one stream must be decompressed whole to read one layer.  With
the CHUNKED flag each layer's K and each layer's V is an independent compressed chunk listed in a chunk
table with its own CRC-32, so one layer (or a token prefix of some layers) is read and checked without
touching the rest, and chunks are decompressed on several threads (lz4 and zstandard release the GIL).

Why the writer works a piece at a time: a server ingests arrays it was sent, and a small compressed
upload can declare large ones.  Each tensor is converted to its stored dtype in row slices of about
4 MiB, each chunk is compressed and written as soon as it is made (the chunk table, which comes first
in the file, is written last, and the file's CRC-32 is combined from the table's and the chunks'),
and a tensor that needs converting is assembled in one reused buffer, which can live in a file
(``scratch``: the bucket's nameless files) rather than in anonymous memory.  Writing thus holds about
one compressed chunk in memory, not the whole context converted; an encrypted file, whose header
(authenticated with every chunk) needs every chunk's size first, still holds all its chunks.

Why the header is trusted for nothing: every size in it is recomputed from the shape with Python
integers and compared, the file length must match exactly, and a compressed file may not claim more
than ``max_decompressed_bytes`` of payload (a decompression bomb is refused before anything is
allocated).
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from mcf._core.fs import preallocate
from mcf._core.optional import require
from mcf._core.lifetime import ClosedOnExit
from mcf.bucket import _layout as L
from mcf.errors import (
    ChecksumError,
    FormatError,
    InvalidArgumentError,
    MCFError,
    TruncatedError,
    UnsupportedVersionError,
    os_error,
)

__all__ = ["DEFAULT_MAX_DECOMPRESSED_BYTES", "Int8KV", "KVFile", "KVHeader", "open_kv", "write_kv"]

#: a compressed file may not declare a larger payload than this unless the caller raises the limit
DEFAULT_MAX_DECOMPRESSED_BYTES = 64 * 2**30
#: more layers than any model has: the cap bounds the work on a file whose layers hold no bytes (0 tokens)
MAX_LAYERS = 4096
#: lz4's block format cannot compress inputs larger than this (LZ4_MAX_INPUT_SIZE)
LZ4_MAX_INPUT = 0x7E000000
_U32 = 2**32 - 1
_CRC_PIECE = 64 * 2**20
#: input bytes of one tensor converted at a time (float -> float16, bfloat16, int8 work on row slices)
_ENCODE_PIECE = 4 * 2**20

try:
    from mcf.bucket._codec import lz4_block_decompress_into as _lz4_into
except ImportError:  # pragma: no cover - the compiled module is built with the package
    _lz4_into = None

try:  # zlib-ng's CRC-32 (folding with carry-less multiply) computes the same value ~6x faster than zlib's
    from zlib_ng.zlib_ng import crc32 as _crc32

    CRC_BACKEND = "zlib-ng"
except ImportError:  # the 'bucket' extra installs it; zlib is the always-present fallback
    _crc32 = zlib.crc32
    CRC_BACKEND = "zlib"

#: the CRC-32 of every checksum in a bucket (zlib's value; zlib-ng's faster code when installed)
crc32 = _crc32

try:  # BF16 comes back as ml_dtypes.bfloat16 when installed, else as the raw uint16 bits
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - the test extra installs ml_dtypes
    _BF16 = None

NP_DTYPES = {
    L.KVDType.FP32: np.dtype("<f4"),
    L.KVDType.FP16: np.dtype("<f2"),
    L.KVDType.BF16: _BF16 if _BF16 is not None else np.dtype("<u2"),
    L.KVDType.INT8: np.dtype("i1"),
}


class Int8KV(NamedTuple):
    """An int8 tensor as stored: ``data`` [heads, tokens, head_dim] and ``scales`` [heads, tokens]
    (float32); the value is ``data * scales[..., None]``."""

    data: np.ndarray
    scales: np.ndarray

    def dequantize(self) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):   # a damaged scale (inf: 0 * inf is NaN) decodes quietly
            return self.data.astype(np.float32) * self.scales[..., None]


@dataclass(frozen=True)
class KVHeader:
    version: int
    flags: int
    shape: L.KVShape
    dtype: L.KVDType
    compression: L.Compression
    original_size: int
    compressed_size: int
    checksum: int

    @property
    def chunked(self) -> bool:
        return bool(self.flags & L.Flags.CHUNKED)

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & L.Flags.ENCRYPTED)

    def pack(self) -> bytes:
        s = self.shape
        return L.HEADER.pack(L.MAGIC, self.version, self.flags, s.num_layers, s.num_kv_heads, s.head_dim,
                             s.sequence_length, int(self.dtype), int(self.compression), self.original_size,
                             self.compressed_size, self.checksum, bytes(18))


# ------------------------------------------------------------------------------------------------
# encoding
# ------------------------------------------------------------------------------------------------
def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bits, rounding to nearest even (NaN stays NaN), the rounding ml_dtypes uses."""
    if _BF16 is not None and x.dtype == _BF16:
        return x.view(np.uint16)
    if x.dtype.itemsize > 4 or x.dtype.kind in "iu":
        # float64 (and integers past 2**24) through float32 would round twice: round once from the exact value
        from mcf._core._fpconv import f64_to_bf16

        return f64_to_bf16(np.asarray(x, dtype=np.float64))
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def quantize_int8(x: np.ndarray) -> Int8KV:
    """Symmetric per-row int8: scale = max|row| / 127 (0 for an all-zero row), q = rint(x / scale)."""
    with np.errstate(over="ignore"):   # float64 beyond float32's range becomes infinity, refused below
        f = np.asarray(x, dtype=np.float32)
    if not np.isfinite(f).all():
        raise InvalidArgumentError("int8 KV storage needs finite values within float32's range (got NaN, infinity "
                                   "or a float64 beyond +-3.4e38)")
    amax = np.abs(f).max(axis=-1) if f.shape[-1] else np.zeros(f.shape[:-1], np.float32)
    scales = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.clip(np.rint(f / safe[..., None]), -127, 127).astype(np.int8)
    return Int8KV(q, scales)


def _kv_array(t: Any, where: str) -> np.ndarray:
    """``t`` as a numpy array of a dtype KV data can have: floats (bfloat16 included) or integers.
    Complex, bool, datetime, string, object and structured arrays are refused, never coerced (a cast
    would drop imaginary parts or turn text into numbers silently)."""
    try:
        a = t if isinstance(t, np.ndarray) else np.asarray(t)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(f"{where}: not an array of numbers ({exc})") from None
    if a.dtype.kind not in "fiu" and not (_BF16 is not None and a.dtype == _BF16):
        raise InvalidArgumentError(f"{where}: KV data must be floating point or integer, got dtype {a.dtype}")
    return a


def _as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _encoded_pieces(t: Any, dtype: L.KVDType) -> Iterator[np.ndarray]:
    """The stored bytes of one tensor (uint8 arrays, in file order), converted a row slice of about
    :data:`_ENCODE_PIECE` input bytes at a time; a tensor already stored as it is comes out as one view
    of itself.  int8: the quantized rows, then the scales (a row is quantized whole, so slices give the
    bytes the whole tensor would)."""
    if isinstance(t, Int8KV):
        if dtype != L.KVDType.INT8:
            raise InvalidArgumentError("an Int8KV tensor can only be written with dtype int8")
        yield _as_bytes(np.ascontiguousarray(t.data, np.int8))
        yield _as_bytes(np.ascontiguousarray(t.scales, "<f4"))
        return
    arr = _kv_array(t, "KV tensor")
    if arr.nbytes <= _ENCODE_PIECE or arr.ndim != 3:
        slices = [arr]
    else:
        heads, tokens, dim = arr.shape
        step = max(1, _ENCODE_PIECE // max(1, dim * arr.dtype.itemsize))
        slices = (arr[h, a:a + step] for h in range(heads) for a in range(0, tokens, step))
    scales = []
    for piece in slices:
        if dtype == L.KVDType.INT8:
            q = quantize_int8(piece)
            scales.append(q.scales.reshape(-1))
            yield _as_bytes(q.data)
        elif dtype == L.KVDType.BF16:
            yield _as_bytes(_to_bf16_bits(piece).astype("<u2", copy=False))
        else:
            # beyond float16's (float32's) range is infinity, as a cast should be; the errstate is left before the
            # yield (a generator closed in another context could not restore it)
            with np.errstate(over="ignore"):
                out = np.ascontiguousarray(piece, dtype=NP_DTYPES[dtype])
            yield _as_bytes(out)
    if dtype == L.KVDType.INT8:
        yield _as_bytes(np.concatenate(scales).astype("<f4", copy=False) if scales else np.empty(0, "<f4"))


class _Buffer:
    """One reused buffer of ``size`` bytes where a tensor's converted pieces are put together for its
    compressor: in a file from ``scratch()`` (mapped) when given, else in memory; made on first use."""

    def __init__(self, size: int, scratch: Callable[[], BinaryIO] | None) -> None:
        self.size, self.scratch = size, scratch
        self.array: np.ndarray | None = None
        self._file = self._map = None

    def get(self) -> np.ndarray:
        if self.array is None:
            if self.scratch is not None and self.size:
                self._file = self.scratch()
                # the blocks are allocated now: a full disk is ENOSPC here, not SIGBUS on a write to the map
                preallocate(self._file.fileno(), self.size)
                self._map = mmap.mmap(self._file.fileno(), self.size)
                self.array = np.frombuffer(self._map, np.uint8)
            else:
                self.array = np.empty(self.size, np.uint8)
        return self.array

    def close(self) -> None:
        self.array = None  # the map's only export
        if self._map is not None:
            self._map.close()
            self._file.close()
            self._map = self._file = None


def _tensor_bytes(t: Any, dtype: L.KVDType, buf: _Buffer) -> np.ndarray:
    """All stored bytes of tensor ``t``: a view of it when it needs no conversion, else assembled in
    ``buf`` (valid until ``buf`` is used again)."""
    pieces = _encoded_pieces(t, dtype)
    first = next(pieces, None)
    second = next(pieces, None)
    if second is None:
        return first if first is not None else np.empty(0, np.uint8)
    out, pos = buf.get(), 0
    for p in itertools.chain((first, second), pieces):  # one piece alive at a time
        out[pos:pos + p.size] = p
        pos += p.size
    return out[:pos]


def _compress(data: bytes, compression: L.Compression, level: int | None) -> bytes:
    if compression == L.Compression.LZ4:
        lz4_block = require("lz4.block", feature="lz4 compression of KV files", extra="bucket", package="lz4")
        if len(data) > LZ4_MAX_INPUT:
            raise InvalidArgumentError(f"lz4 cannot compress a block of {len(data)} bytes (limit {LZ4_MAX_INPUT})")
        if level is None:
            return lz4_block.compress(data, store_size=False)
        return lz4_block.compress(data, store_size=False, mode="high_compression", compression=level)
    if compression == L.Compression.ZSTD:
        zstandard = require("zstandard", feature="zstd compression of KV files", extra="bucket")
        return zstandard.ZstdCompressor(level=3 if level is None else level, write_content_size=True).compress(data)
    return data


def shape_of(layers: Sequence[Sequence[Any]]) -> L.KVShape:
    if not isinstance(layers, (list, tuple)) or len(layers) == 0:
        raise InvalidArgumentError("layers must be a non-empty list of (K, V) pairs")
    first = None
    for i, pair in enumerate(layers):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidArgumentError(f"layer {i}: expected a (K, V) pair")
        for name, t in zip("KV", pair):
            shp = tuple(t.data.shape) if isinstance(t, Int8KV) else _kv_array(t, f"layer {i} {name}").shape
            if isinstance(t, Int8KV) and tuple(np.shape(t.scales)) != shp[:2]:
                raise InvalidArgumentError(f"layer {i} {name}: scales shape {np.shape(t.scales)} != {shp[:2]}")
            if len(shp) != 3:
                raise InvalidArgumentError(f"layer {i} {name}: expected [num_kv_heads, sequence_length, head_dim], "
                                           f"got shape {shp}")
            if first is None:
                first = shp
            elif shp != first:
                raise InvalidArgumentError(f"layer {i} {name}: shape {shp} differs from layer 0 K {first}")
    if len(layers) > MAX_LAYERS:
        raise InvalidArgumentError(f"{len(layers)} layers: a KV file holds at most {MAX_LAYERS}")
    if len(layers) > _U32 or any(d > _U32 for d in first):
        raise InvalidArgumentError("a dimension does not fit the header's u32 fields")
    return L.KVShape(len(layers), first[0], first[2], first[1])


def write_kv(dest: str | os.PathLike | BinaryIO, layers: Sequence[Sequence[Any]], *, dtype: Any = "float16",
             compression: Any = "none", level: int | None = None, chunked: bool | None = None,
             threads: int = 1, key: Any = None, scratch: Callable[[], BinaryIO] | None = None) -> KVHeader:
    """Write a KV cache: ``layers[i] = (K, V)``, each ``[num_kv_heads, sequence_length, head_dim]``.

    ``dtype`` is the stored dtype (float inputs are converted; int8 quantizes per row, see
    :func:`quantize_int8`, or takes :class:`Int8KV` pairs as they are).  ``compression`` is none, lz4
    or zstd; compressed files are CHUNKED unless ``chunked=False`` (one stream).  ``key`` (32 bytes or 64
    hex digits) encrypts every chunk with AES-256-GCM (always CHUNKED; see :mod:`mcf.bucket._crypto`).
    ``threads`` chunks are compressed at once.  ``scratch()``, when given, returns a new empty
    read-write binary file in which a tensor that needs converting is assembled for its compressor
    (mapped, so the memory is the file's cache, which the kernel can drop, not the process's own).
    A file ``dest`` must be seekable (the header and chunk table are written last).  Returns the header.
    """
    from mcf.bucket._crypto import ChunkCipher, OVERHEAD, parse_key

    kd = L.parse_dtype(dtype)
    comp = L.parse_compression(compression)
    key = parse_key(key)
    if key is not None:
        if chunked is False:
            raise InvalidArgumentError("an encrypted KV file is always chunked")
        chunked = True
    if chunked is None:
        chunked = comp != L.Compression.NONE
    if chunked and comp == L.Compression.NONE and key is None:
        raise InvalidArgumentError("chunked=True needs a compression (uncompressed data is addressable as is)")
    if not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
    shape = shape_of(layers)
    original = L.payload_size(shape, kd)
    tensors = [t for pair in layers for t in pair]
    flags = int(L.Flags.CHUNKED) if chunked else 0
    if key is not None:
        flags |= int(L.Flags.ENCRYPTED)

    own = not hasattr(dest, "write")
    if own:
        from mcf.remote import refuse_url

        refuse_url(dest, what="writing an MCB file")  # remote files are read-only
    try:
        f = open(dest, "wb") if own else dest
    except OSError as exc:
        raise os_error(exc, dest) from exc
    try:
        start = f.tell()
        f.write(bytes(L.HEADER_SIZE))
        if not chunked:
            stored, crc = _write_stream(f, tensors, kd, comp, level, original)
        else:
            table_size = L.chunk_table_size(shape)
            sizes = _tensor_size(shape, kd)
            f.write(bytes(table_size))  # the table's place: it is known once every chunk is
            entries = bytearray()
            off, crc_chunks, chunk_bytes = L.HEADER_SIZE + table_size, 0, 0
            chunks = _chunks(tensors, kd, comp, level, threads, scratch, sizes)
            if key is not None:
                # the header is authenticated with every chunk, so its sizes come first: each chunk
                # grows by its nonce and tag, and all of them are held until then
                chunks = list(chunks)
                stored_size = table_size + sum(len(c) + OVERHEAD for c in chunks)
                cipher = ChunkCipher(key, KVHeader(L.VERSION, flags, shape, kd, comp, original, stored_size, 0).pack())
                chunks = (cipher.encrypt(i, c) for i, c in enumerate(chunks))
            for c in chunks:
                f.write(c)
                c_crc = _crc32(c)
                entries += L.CHUNK_ENTRY.pack(off, len(c), c_crc, 0)
                crc_chunks = _crc32(c, crc_chunks)
                off += len(c)
                chunk_bytes += len(c)
            table = bytes(entries) + L.CHUNK_TRAILER.pack(_crc32(entries))
            f.seek(start + L.HEADER_SIZE)
            f.write(table)
            stored = table_size + chunk_bytes
            crc = _crc32_combine(_crc32(table), crc_chunks, chunk_bytes)
        header = KVHeader(L.VERSION, flags, shape, kd, comp, original, stored, crc)
        f.seek(start)
        f.write(header.pack())
        f.seek(start + L.HEADER_SIZE + stored)
        f.flush()
    except OSError as exc:
        raise os_error(exc, dest) from exc
    finally:
        if own:
            f.close()
    return header


def _tensor_size(shape: L.KVShape, dtype: L.KVDType) -> int:
    """The stored bytes of one tensor (one chunk before compression)."""
    return L.payload_size(L.KVShape(1, shape.num_kv_heads, shape.head_dim, shape.sequence_length), dtype) // 2


def _write_stream(f: BinaryIO, tensors: list, kd: L.KVDType, comp: L.Compression, level: int | None,
                  original: int) -> tuple[int, int]:
    """An unchunked payload, after the header: the tensors' bytes in pieces, or (compressed as one
    stream) their bytes joined first.  Returns (stored bytes, their CRC-32)."""
    crc = stored = 0
    if comp == L.Compression.NONE:
        for t in tensors:
            for p in _encoded_pieces(t, kd):
                f.write(p)
                crc = _crc32(p, crc)
                stored += p.size
        if stored != original:  # pragma: no cover
            raise InvalidArgumentError("internal size mismatch")
        return stored, crc
    data = _compress(b"".join(p.tobytes() for t in tensors for p in _encoded_pieces(t, kd)), comp, level)
    f.write(data)
    return len(data), _crc32(data)


def _chunks(tensors: list, kd: L.KVDType, comp: L.Compression, level: int | None, threads: int,
            scratch: Callable[[], BinaryIO] | None, size: int) -> Iterator[bytes]:
    """Each tensor's chunk (its stored bytes, compressed unless ``comp`` is none), in order, made at
    most ``threads`` at a time, each in one of ``threads`` reused buffers of ``size`` bytes."""
    bufs = [_Buffer(size, scratch) for _ in range(min(threads, len(tensors)))]

    def make(t: Any, buf: _Buffer) -> bytes:
        data = _tensor_bytes(t, kd, buf)
        return data.tobytes() if comp == L.Compression.NONE else _compress(data, comp, level)

    try:
        if len(bufs) <= 1:
            for t in tensors:
                yield make(t, bufs[0])
        else:
            with ThreadPoolExecutor(len(bufs)) as pool:
                for i in range(0, len(tensors), len(bufs)):
                    batch = tensors[i:i + len(bufs)]
                    yield from pool.map(make, batch, bufs[:len(batch)])
    finally:
        for b in bufs:
            b.close()


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _zero_operators() -> list[list[int]]:
    """The CRC-32 operators that append 2**k zero bytes, k = 0..63 (zlib's crc32_combine, made once)."""
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]
    op = one_bit
    for _ in range(3):  # one zero bit -> one zero byte
        op = [_gf2_times(op, op[n]) for n in range(32)]
    ops = []
    for _ in range(64):
        ops.append(op)
        op = [_gf2_times(op, op[n]) for n in range(32)]
    return ops


_ZERO_OPS: list[list[int]] = []


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len2 = len(b)``: the
    chunk table comes before the chunks in the file but is known only after them."""
    if not _ZERO_OPS:
        _ZERO_OPS.extend(_zero_operators())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


# ------------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------------
def parse_header(raw: bytes, *, path: Any = None, file_size: int | None = None,
                 max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> KVHeader:
    """Validate the 64 header bytes against each other and against the file size."""
    if len(raw) < L.HEADER_SIZE:
        raise TruncatedError("file shorter than the 64-byte header", path=path, field="header", offset=0,
                             expected=L.HEADER_SIZE, got=len(raw))
    (magic, version, flags, nl, nh, hd, seq, dt, comp, orig, csize, crc,
     reserved) = L.HEADER.unpack(raw[:L.HEADER_SIZE])
    OFF = L.OFFSETS
    if magic != L.MAGIC:
        raise FormatError("not an MCB KV file", path=path, field="magic", offset=0, expected=L.MAGIC, got=magic)
    if version != L.VERSION:
        raise UnsupportedVersionError("unsupported KV file version", path=path, field="version",
                                      offset=OFF["version"], expected=L.VERSION, got=version)
    if flags & ~L.KNOWN_FLAGS:
        raise FormatError("unknown flag bits", path=path, field="flags", offset=OFF["flags"],
                          expected=f"subset of {L.KNOWN_FLAGS:#x}", got=f"{flags:#x}")
    if reserved != bytes(18):
        raise FormatError("reserved bytes are not zero", path=path, field="reserved", offset=OFF["reserved"])
    try:
        kd = L.KVDType(dt)
    except ValueError:
        raise FormatError("unknown dtype code", path=path, field="dtype", offset=OFF["dtype"], expected="0..3",
                          got=dt) from None
    try:
        cp = L.Compression(comp)
    except ValueError:
        raise FormatError("unknown compression code", path=path, field="compression", offset=OFF["compression"],
                          expected="0..2", got=comp) from None
    if nl == 0:
        raise FormatError("a KV file holds at least one layer", path=path, field="num_layers",
                          offset=OFF["num_layers"], got=0)
    if nl > MAX_LAYERS:
        raise FormatError("more layers than any model has", path=path, field="num_layers", offset=OFF["num_layers"],
                          expected=f"<= {MAX_LAYERS}", got=nl)
    shape = L.KVShape(nl, nh, hd, seq)
    if math.prod(d for d in (nh, seq, hd) if d) * 4 >= 2**63:  # numpy refuses even an empty array that big
        raise FormatError("shape too large for an array", path=path, field="num_kv_heads",
                          offset=OFF["num_kv_heads"], expected="non-zero dims * 4 < 2**63", got=(nh, seq, hd))
    want = L.payload_size(shape, kd)
    if orig != want:
        raise FormatError("original_size disagrees with the shape and dtype", path=path, field="original_size",
                          offset=OFF["original_size"], expected=want, got=orig)
    chunked = bool(flags & L.Flags.CHUNKED)
    encrypted = bool(flags & L.Flags.ENCRYPTED)
    if encrypted and not chunked:
        raise FormatError("ENCRYPTED flag without CHUNKED (encryption is per chunk)", path=path, field="flags",
                          offset=OFF["flags"], got=f"{flags:#x}")
    if encrypted:
        if orig > max_decompressed_bytes:
            raise FormatError("declared payload exceeds the decompression limit", path=path, field="original_size",
                              offset=OFF["original_size"], expected=f"<= {max_decompressed_bytes}", got=orig)
        if csize < L.chunk_table_size(shape):
            raise FormatError("compressed_size smaller than the chunk table", path=path, field="compressed_size",
                              offset=OFF["compressed_size"], expected=f">= {L.chunk_table_size(shape)}", got=csize)
    elif cp == L.Compression.NONE:
        if chunked:
            raise FormatError("CHUNKED flag on an uncompressed file", path=path, field="flags", offset=OFF["flags"])
        if csize != orig:
            raise FormatError("compressed_size of an uncompressed file must equal original_size", path=path,
                              field="compressed_size", offset=OFF["compressed_size"], expected=orig, got=csize)
    else:
        if orig > max_decompressed_bytes:
            raise FormatError("declared payload exceeds the decompression limit (possible decompression bomb)",
                              path=path, field="original_size", offset=OFF["original_size"],
                              expected=f"<= {max_decompressed_bytes}", got=orig)
        if chunked and csize < L.chunk_table_size(shape):
            raise FormatError("compressed_size smaller than the chunk table", path=path, field="compressed_size",
                              offset=OFF["compressed_size"], expected=f">= {L.chunk_table_size(shape)}", got=csize)
    if file_size is not None:
        total = L.HEADER_SIZE + csize
        if file_size < total:
            raise TruncatedError("file ends before the data the header declares", path=path, field="compressed_size",
                                 offset=file_size, expected=total, got=file_size)
        if file_size > total:
            raise FormatError("trailing bytes after the declared data", path=path, field="compressed_size",
                              offset=total, expected=total, got=file_size)
    return KVHeader(version, flags, shape, kd, cp, orig, csize, crc)


class KVFile(ClosedOnExit):
    """An opened ``kv_data.mcb``.  Construction validates the header and the chunk table; :meth:`load`
    returns per-layer (K, V) arrays, zero-copy views of the mapping when the file is uncompressed."""

    def __init__(self, source: Any, *, mmap: bool | None = None,
                 max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES, key: Any = None) -> None:
        from mcf.bucket._crypto import ChunkCipher, parse_key
        from mcf.io import open_source

        self._src = open_source(source, mmap=mmap)
        if isinstance(source, (str, os.PathLike)):
            self.path = str(source)
        else:  # a Source opened from a path or a descriptor (mcf.io.open_fd) names its file
            self.path = self._src.name if self._src.path is not None else None
        try:
            size = self._src.size
            raw = self._src.read(0, min(size, L.HEADER_SIZE))
            self.header = parse_header(raw, path=self.path, file_size=size,
                                       max_decompressed_bytes=max_decompressed_bytes)
            self._chunks = self._read_table() if self.header.chunked else None
            key = parse_key(key)
            self._cipher = ChunkCipher(key, raw) if self.header.encrypted and key is not None else None
        except BaseException:
            self._src.close()
            raise
        self._file_verified = False

    # -- structure -----------------------------------------------------------------------------------
    @property
    def shape(self) -> L.KVShape:
        return self.header.shape

    @property
    def dtype(self) -> L.KVDType:
        return self.header.dtype

    def _read_table(self) -> list[tuple[int, int, int]]:
        h = self.header
        n = L.chunk_count(h.shape)
        raw = self._src.read(L.HEADER_SIZE, L.chunk_table_size(h.shape))
        entries = raw[: n * L.CHUNK_ENTRY.size]
        (tcrc,) = L.CHUNK_TRAILER.unpack_from(raw, n * L.CHUNK_ENTRY.size)
        toff = L.HEADER_SIZE + n * L.CHUNK_ENTRY.size
        if _crc32(entries) != tcrc:
            raise ChecksumError("chunk table CRC-32 mismatch", path=self.path, field="chunk_table", offset=toff,
                                expected=f"{tcrc:#010x}", got=f"{_crc32(entries):#010x}")
        expect = L.HEADER_SIZE + L.chunk_table_size(h.shape)
        out = []
        for i in range(n):
            off, size, crc, zero = L.CHUNK_ENTRY.unpack_from(entries, i * L.CHUNK_ENTRY.size)
            eoff = L.HEADER_SIZE + i * L.CHUNK_ENTRY.size
            if off != expect:
                raise FormatError("chunks must be contiguous and in order", path=self.path, field=f"chunk[{i}].offset",
                                  offset=eoff, expected=expect, got=off)
            if zero:
                raise FormatError("chunk entry reserved word is not zero", path=self.path, field=f"chunk[{i}]",
                                  offset=eoff + 20)
            out.append((off, size, crc))
            expect += size
        end = L.HEADER_SIZE + h.compressed_size
        if expect != end:
            raise FormatError("chunk sizes do not add up to compressed_size", path=self.path, field="chunk_table",
                              offset=L.HEADER_SIZE, expected=end, got=expect)
        return out

    # -- checks ----------------------------------------------------------------------------------------
    def fileno(self) -> int:
        """The descriptor of the open file (what was validated: stream from it, not from a path)."""
        return self._src.fileno()

    def identity(self) -> tuple[int, ...] | None:
        """(device, inode, size, mtime_ns, ctime_ns) of the open file, None for in-memory sources.  Any
        write to the file through the file system changes its ctime (which no user can set back), so
        an unchanged identity means unchanged contents, barring faults below the file system."""
        try:
            st = os.fstat(self._src.fileno())
        except (MCFError, OSError):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def verified(self) -> bool:
        """True once :meth:`verify` has checked every byte after the header."""
        return self._file_verified

    def verify(self) -> None:
        """Compare the header's CRC-32 with every byte after the header (raises ChecksumError)."""
        if self._file_verified:
            return
        crc = 0
        pos, end = L.HEADER_SIZE, L.HEADER_SIZE + self.header.compressed_size
        while pos < end:
            n = min(_CRC_PIECE, end - pos)
            crc = _crc32(self._src.view(pos, n), crc)
            pos += n
        if crc != self.header.checksum:
            raise ChecksumError("data CRC-32 mismatch", path=self.path, field="checksum", offset=L.OFFSETS["checksum"],
                                expected=f"{self.header.checksum:#010x}", got=f"{crc:#010x}")
        self._file_verified = True

    def _decompress(self, data: Any, n: int, what: str, offset: int) -> Any:
        comp = self.header.compression
        if comp == L.Compression.LZ4 and _lz4_into is not None:
            out = np.empty(n, np.uint8)
            try:
                _lz4_into(data, out)
            except FormatError as exc:
                raise FormatError(f"cannot decompress: {exc.args[0]}", path=self.path, field=what,
                                  offset=offset) from None
            return out
        try:
            if comp == L.Compression.LZ4:
                lz4_block = require("lz4.block", feature="lz4 decompression of KV files", extra="bucket",
                                    package="lz4")
                out = lz4_block.decompress(data, uncompressed_size=n)
            else:
                zstandard = require("zstandard", feature="zstd-compressed KV files", extra="bucket")
                declared = zstandard.frame_content_size(data)
                if declared not in (-1, n):
                    raise FormatError("zstd frame declares a different decompressed size", path=self.path,
                                      field=what, offset=offset, expected=n, got=declared)
                out = zstandard.ZstdDecompressor().decompress(data, max_output_size=n)
        except MCFError:
            raise
        except Exception as exc:  # lz4.block.LZ4BlockError, zstandard.ZstdError: corrupt stream
            raise FormatError(f"cannot decompress: {exc}", path=self.path, field=what, offset=offset) from None
        if len(out) != n:
            raise FormatError("decompressed size disagrees with the shape", path=self.path, field=what, offset=offset,
                              expected=n, got=len(out))
        return out

    def _chunk_bytes(self, idx: int, verify: bool, dst: np.ndarray | None = None) -> Any:
        """Chunk ``idx`` decompressed (its CRC checked first when ``verify``).  lz4 chunks are decoded
        straight into ``dst`` (a writable uint8 array of the block size; a new one when None), so no
        intermediate bytes object is made; zstd chunks come back as bytes, copied into ``dst`` if given."""
        off, size, crc = self._chunks[idx]
        data = self._src.view(off, size)
        if verify and _crc32(data) != crc:
            raise ChecksumError("chunk CRC-32 mismatch", path=self.path, field=f"chunk[{idx}]", offset=off,
                                expected=f"{crc:#010x}", got=f"{_crc32(data):#010x}")
        n = L.block_size(self.shape, self.dtype)
        if self.header.encrypted:
            if self._cipher is None:
                raise InvalidArgumentError(f"{self.path or 'KV file'}: the KV data is encrypted; pass key= "
                                           "(or set MCF_BUCKET_KEY for a bucket)")
            data = self._cipher.decrypt(idx, data, path=self.path, offset=off)  # authenticated
            if self.header.compression == L.Compression.NONE:
                if len(data) != n:
                    raise FormatError("decrypted chunk size disagrees with the shape", path=self.path,
                                      field=f"chunk[{idx}]", offset=off, expected=n, got=len(data))
                if dst is not None:
                    np.copyto(dst, np.frombuffer(data, np.uint8))
                    return dst
                return data
        if self.header.compression == L.Compression.LZ4 and _lz4_into is not None:
            if dst is None:
                dst = np.empty(n, np.uint8)  # faulted in by this (worker) thread, in parallel with the others
            try:
                _lz4_into(data, dst)
            except FormatError as exc:
                raise FormatError(f"cannot decompress: {exc.args[0]}", path=self.path, field=f"chunk[{idx}]",
                                  offset=off) from None
            return dst
        out = self._decompress(data, n, f"chunk[{idx}]", off)
        if dst is not None:
            np.copyto(dst, np.frombuffer(out, np.uint8))
            return dst
        return out

    # -- loading --------------------------------------------------------------------------------------
    def _block(self, buf: Any, base: int, idx: int) -> np.ndarray | Int8KV:
        """Array(s) of block ``idx`` inside ``buf`` (a Source when base is a file offset, else bytes)."""
        s, kd = self.shape, self.dtype
        shp = (s.num_kv_heads, s.sequence_length, s.head_dim)
        nbytes = s.tensor_elements() * L.DTYPE_ITEMSIZE[kd]
        start = base + idx * L.block_size(s, kd)

        def arr(off, dt, shape):
            if isinstance(buf, (bytes, bytearray, memoryview, np.ndarray)):
                count = int(np.prod(shape))
                return np.frombuffer(buf, dtype=dt, count=count, offset=off).reshape(shape)
            return buf.array(off, dt, shape)

        data = arr(start, NP_DTYPES[kd], shp)
        if kd == L.KVDType.INT8:
            return Int8KV(data, arr(start + nbytes, np.dtype("<f4"), shp[:2]))
        return data

    def load(self, layers: Sequence[int] | int | None = None, *, tokens: int | None = None, threads: int = 2,
             verify: bool = True, dequantize: bool = True,
             out: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> list[tuple[Any, Any]]:
        """Per-layer ``(K, V)`` for ``layers`` (all by default), each ``[heads, tokens, head_dim]``.

        ``tokens=n`` keeps the first n tokens.  Uncompressed files give read-only views of the mapping
        (zero-copy); compressed chunks are decompressed on ``threads`` threads.  ``verify`` checks the
        CRC-32s of what is read: the header CRC over all data for a full load or an unchunked file, the
        CRC of each chunk read for a partial load of a chunked file.  int8
        comes back dequantized to float32 unless ``dequantize=False`` (then as :class:`Int8KV`).

        ``out`` hands in the destination: one writable, C-contiguous ``(K, V)`` pair per selected layer,
        of the stored dtype and shape ``[heads, tokens, head_dim]`` (a runtime's own KV buffers).  lz4
        chunks are then decoded straight into them and other data copied, on ``threads`` threads; the
        same arrays are returned.  Not for int8 (its scales travel with the data).
        """
        s = self.shape
        sel, ntok = L.selection(layers, tokens, s.num_layers, s.sequence_length)
        if not isinstance(threads, int) or threads < 1:
            raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
        dests = self._check_out(out, len(sel), ntok) if out is not None else None
        comp = self.header.compression
        idxs = [2 * i + kv for i in sel for kv in (0, 1)]

        def run(fn, items):
            if threads > 1 and len(items) > 1:
                with ThreadPoolExecutor(min(threads, len(items))) as pool:
                    return list(pool.map(fn, items))
            return [fn(x) for x in items]

        if comp == L.Compression.NONE and self._chunks is None:
            if verify:
                self.verify()
            blocks = [self._block(self._src, L.HEADER_SIZE, j) for j in idxs]
        elif self._chunks is None:
            if verify:
                self.verify()
            payload = self._decompress(self._src.view(L.HEADER_SIZE, self.header.compressed_size),
                                       self.header.original_size, "data", L.HEADER_SIZE)
            blocks = [self._block(payload, 0, j) for j in idxs]
        else:
            # a full load reads every byte anyway: check the header CRC once instead of each chunk's
            whole = verify and len(sel) == s.num_layers
            if whole:
                self.verify()
            direct = dests is not None and ntok == s.sequence_length
            bs = L.block_size(s, self.dtype)
            # lz4 without out=: one allocation for every block, sliced per chunk, so the worker threads
            # only page-fault into it (in parallel) instead of each mapping and unmapping its own buffers
            # (which serializes them on the address-space lock)
            big = (np.empty(len(idxs) * bs, np.uint8)
                   if not direct and comp == L.Compression.LZ4 and _lz4_into is not None else None)

            def one(k):
                if direct:
                    dst = dests[k].reshape(-1).view(np.uint8)
                else:
                    dst = big[k * bs:(k + 1) * bs] if big is not None else None
                raw = self._chunk_bytes(idxs[k], verify and not whole, dst)
                return dests[k] if direct else self._block(raw, 0, 0)

            blocks = run(one, range(len(idxs)))
            if direct:
                return [(blocks[2 * k], blocks[2 * k + 1]) for k in range(len(sel))]

        def finish(b):
            if isinstance(b, Int8KV):
                if tokens is not None:
                    b = Int8KV(b.data[:, :tokens], b.scales[:, :tokens])
                return b.dequantize() if dequantize else b
            return b if tokens is None else b[:, :tokens]

        if dests is not None:
            def copy(k):
                np.copyto(dests[k], blocks[k][:, :ntok])
                return dests[k]

            done = run(copy, range(len(idxs)))
            return [(done[2 * k], done[2 * k + 1]) for k in range(len(sel))]
        res = [finish(b) for b in blocks]
        return [(res[2 * k], res[2 * k + 1]) for k in range(len(sel))]

    def load_copy(self, layers: Sequence[int] | int | None = None, *, tokens: int | None = None, threads: int = 2,
                  verify: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
        """Like :meth:`load`, but into new arrays the caller owns (writable, never views of the file),
        each byte decompressed or copied once: lz4 chunks are decoded straight into them.  int8 comes
        back dequantized to float32 (new arrays too)."""
        if self.dtype == L.KVDType.INT8:
            return self.load(layers, tokens=tokens, threads=threads, verify=verify)
        s = self.shape
        n = s.num_layers if layers is None else 1 if isinstance(layers, (int, np.integer)) else len(list(layers))
        ntok = s.sequence_length if tokens is None or not isinstance(tokens, (int, np.integer)) else int(tokens)
        shp, dt = (s.num_kv_heads, max(0, min(ntok, s.sequence_length)), s.head_dim), NP_DTYPES[self.dtype]
        out = [(np.empty(shp, dt), np.empty(shp, dt)) for _ in range(n)]  # not touched until filled
        return self.load(layers, tokens=tokens, threads=threads, verify=verify, out=out)

    def _check_out(self, out: Any, n_layers: int, ntok: int) -> list[np.ndarray]:
        s, kd = self.shape, self.dtype
        if kd == L.KVDType.INT8:
            raise InvalidArgumentError("out= is not supported for int8 KV files (scales travel with the data)")
        if not isinstance(out, (list, tuple)) or len(out) != n_layers:
            raise InvalidArgumentError(f"out must be a list of {n_layers} (K, V) pairs")
        want_shape, want_dtype = (s.num_kv_heads, ntok, s.head_dim), NP_DTYPES[kd]
        flat = []
        for i, pair in enumerate(out):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InvalidArgumentError(f"out[{i}]: expected a (K, V) pair")
            for name, a in zip("KV", pair):
                if not isinstance(a, np.ndarray) or a.dtype != want_dtype or a.shape != want_shape:
                    raise InvalidArgumentError(
                        f"out[{i}] {name}: expected a numpy array of dtype {want_dtype} and shape {want_shape}, got "
                        f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
                if not (a.flags.c_contiguous and a.flags.writeable):
                    raise InvalidArgumentError(f"out[{i}] {name}: must be C-contiguous and writable")
                flat.append(a)
        if len({id(a) for a in flat}) != len(flat) or any(
                np.may_share_memory(a, b) for i, a in enumerate(flat) for b in flat[i + 1:]):
            raise InvalidArgumentError("out arrays must not overlap")
        return flat

    def close(self) -> None:
        self._src.close()


def open_kv(source: Any, *, mmap: bool | None = None, max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
            key: Any = None) -> KVFile:
    """Open and validate a ``kv_data.mcb`` (path, file-like object or bytes-like); ``key`` decrypts an
    encrypted one.  A path is mapped on a local disk and read with positional reads on a network or
    FUSE filesystem (``mmap=None``, the default); ``mmap=True``/``False`` decides instead."""
    return KVFile(source, mmap=mmap, max_decompressed_bytes=max_decompressed_bytes, key=key)


def read_kv(source: Any, **kw: Any) -> list[tuple[Any, Any]]:
    """Convenience: open, load everything as copies owned by the caller, close."""
    # the rest goes to open_kv
    load_kw = {k: kw.pop(k) for k in ("layers", "tokens", "threads", "verify", "dequantize") if k in kw}
    with open_kv(source, **kw) as f:
        if load_kw.pop("dequantize", True) or f.dtype != L.KVDType.INT8:
            return f.load_copy(**load_kw)
        return [(Int8KV(np.array(k.data), np.array(k.scales)), Int8KV(np.array(v.data), np.array(v.scales)))
                for k, v in f.load(dequantize=False, **load_kw)]

