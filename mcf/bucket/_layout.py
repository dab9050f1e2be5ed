"""The byte layout of ``kv_data.mcb``, in one place: the 64-byte header, the dtype and compression
codes, the flags and the chunk table.  See docs/bucket.md for the same facts in prose.

Everything is little-endian.  The header (FORMATS.md §4)::

    off size field
      0   4  magic            b"MCB\\0"
      4   2  version          1
      6   2  flags            bit 0 = CHUNKED (a chunk table follows the header)
                              bit 1 = ENCRYPTED (chunks are AES-256-GCM; needs CHUNKED; see _crypto.py)
      8   4  num_layers
     12   4  num_kv_heads
     16   4  head_dim
     20   4  sequence_length
     24   1  dtype            0 fp32, 1 fp16, 2 bf16, 3 int8
     25   1  compression      0 none, 1 lz4, 2 zstd
     26   8  original_size    bytes of the uncompressed payload (tensors + int8 scales)
     34   8  compressed_size  bytes stored after the header (chunk table included); file = 64 + this
     42   4  checksum         CRC-32 (zlib) of every byte after the header
     46  18  reserved         zero
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import numpy as np

from mcf._core.args import integer
from mcf.errors import InvalidArgumentError

MAGIC = b"MCB\0"
VERSION = 1
HEADER = struct.Struct("<4sHHIIIIBBQQI18s")
HEADER_SIZE = HEADER.size  # 64
assert HEADER_SIZE == 64

#: byte offsets of each header field (for error messages)
OFFSETS = {
    "magic": 0, "version": 4, "flags": 6, "num_layers": 8, "num_kv_heads": 12, "head_dim": 16,
    "sequence_length": 20, "dtype": 24, "compression": 25, "original_size": 26,
    "compressed_size": 34, "checksum": 42, "reserved": 46,
}


class Flags(IntFlag):
    CHUNKED = 1
    ENCRYPTED = 2


KNOWN_FLAGS = int(Flags.CHUNKED | Flags.ENCRYPTED)


class KVDType(IntEnum):
    FP32 = 0
    FP16 = 1
    BF16 = 2
    INT8 = 3


class Compression(IntEnum):
    NONE = 0
    LZ4 = 1
    ZSTD = 2


#: dtype code -> (name, element size in bytes)
DTYPE_NAMES = {KVDType.FP32: "float32", KVDType.FP16: "float16", KVDType.BF16: "bfloat16", KVDType.INT8: "int8"}
DTYPE_ITEMSIZE = {KVDType.FP32: 4, KVDType.FP16: 2, KVDType.BF16: 2, KVDType.INT8: 1}
_DTYPE_ALIASES = {
    "float32": KVDType.FP32, "fp32": KVDType.FP32, "f32": KVDType.FP32,
    "float16": KVDType.FP16, "fp16": KVDType.FP16, "f16": KVDType.FP16, "half": KVDType.FP16,
    "bfloat16": KVDType.BF16, "bf16": KVDType.BF16,
    "int8": KVDType.INT8, "i8": KVDType.INT8,
}
COMPRESSION_NAMES = {Compression.NONE: "none", Compression.LZ4: "lz4", Compression.ZSTD: "zstd"}
_COMPRESSION_ALIASES = {"none": Compression.NONE, "lz4": Compression.LZ4, "zstd": Compression.ZSTD}

#: int8 stores one float32 scale per (kv_head, token) row of head_dim values: x ~= q * scale
SCALE_ITEMSIZE = 4

#: chunk table entry: u64 offset from file start | u64 stored size | u32 CRC-32 of the stored bytes |
#: u32 reserved zero.  The table ends with the u32 CRC-32 of the entries.
CHUNK_ENTRY = struct.Struct("<QQII")
CHUNK_TRAILER = struct.Struct("<I")


def parse_dtype(value) -> KVDType:
    if isinstance(value, KVDType):
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[value.lower()]
    if isinstance(value, np.dtype) or isinstance(value, type):
        name = np.dtype(value).name
        if name in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[name]
    from mcf.errors import InvalidArgumentError

    raise InvalidArgumentError(f"unknown KV dtype {value!r} (expected one of float32, float16, bfloat16, int8)")


def parse_compression(value) -> Compression:
    if isinstance(value, Compression):
        return value
    if value is None or value is False:
        return Compression.NONE
    if isinstance(value, str) and value.lower() in _COMPRESSION_ALIASES:
        return _COMPRESSION_ALIASES[value.lower()]
    from mcf.errors import InvalidArgumentError

    raise InvalidArgumentError(f"unknown compression {value!r} (expected none, lz4 or zstd)")


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sequence_length: int

    def tensor_elements(self) -> int:
        return self.num_kv_heads * self.sequence_length * self.head_dim


def block_size(shape: KVShape, dtype: KVDType) -> int:
    """Bytes of one stored K or V tensor of one layer (int8: data then its float32 scales)."""
    n = shape.tensor_elements() * DTYPE_ITEMSIZE[dtype]
    if dtype == KVDType.INT8:
        n += shape.num_kv_heads * shape.sequence_length * SCALE_ITEMSIZE
    return n


def payload_size(shape: KVShape, dtype: KVDType) -> int:
    return 2 * shape.num_layers * block_size(shape, dtype)


def chunk_count(shape: KVShape) -> int:
    """One chunk per layer and K/V: chunk 2*layer is K, 2*layer+1 is V."""
    return 2 * shape.num_layers


def chunk_table_size(shape: KVShape) -> int:
    return chunk_count(shape) * CHUNK_ENTRY.size + CHUNK_TRAILER.size


def selection(layers, tokens, num_layers: int, sequence_length: int) -> tuple[list[int], int]:
    """``(layer indices, token count)`` of a load: ``layers`` None (all), one index or a sequence of them,
    each in ``0..num_layers-1``; ``tokens`` None (all) or a count in ``0..sequence_length``.  Indices and
    counts follow mcf._core.args.integer (Python or numpy integers; ``True`` is not layer 1 nor one
    token), checked in one place for the cold path (KVFile.load) and the warm and hot tiers (tiers.select)."""
    if layers is None:
        sel = list(range(num_layers))
    else:
        items = list(layers) if isinstance(layers, (list, tuple, range, np.ndarray)) else [layers]
        sel = [integer(i, "a layer index") for i in items]
        for i in sel:
            if not 0 <= i < num_layers:
                raise InvalidArgumentError(f"layer {i!r} out of range 0..{num_layers - 1}")
    if tokens is None:
        return sel, sequence_length
    n = integer(tokens, "tokens")
    if not 0 <= n <= sequence_length:
        raise InvalidArgumentError(f"tokens must be in 0..{sequence_length}, got {n!r}")
    return sel, n
