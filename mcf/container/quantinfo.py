"""The QuantInfo section (0x0002): one record per quantized tensor, for reproducibility.

    header: u32 version=1 | u32 record_count
    record (24 bytes): u32 tensor_index | u8 method | u8 domain | u16 block_size | u16 super_size
                       | u8[6] reserved=0 | f32 min_clip | f32 max_clip

``tensor_index`` is the position in the TensorIndex's sorted entry array and ``method`` must equal that
entry's dtype; the reader cross-checks both (see :meth:`mcf.Container.quant_info`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from mcf.errors import FormatError, TruncatedError, UnsupportedVersionError

__all__ = ["QuantRecord", "encode_quant_info", "decode_quant_info", "RECORD"]

HEADER = struct.Struct("<II")
RECORD = struct.Struct("<IBBHH6sff")
assert RECORD.size == 24
VERSION = 1

_RECORD_DTYPE = np.dtype([
    ("tensor_index", "<u4"), ("method", "u1"), ("domain", "u1"), ("block_size", "<u2"),
    ("super_size", "<u2"), ("reserved", "V6"), ("min_clip", "<f4"), ("max_clip", "<f4"),
])
assert _RECORD_DTYPE.itemsize == 24


@dataclass(frozen=True)
class QuantRecord:
    tensor_index: int
    method: int
    domain: int
    block_size: int
    super_size: int
    min_clip: float
    max_clip: float
    name: str | None = None  # filled by the container from the tensor index


def encode_quant_info(records) -> bytes:
    out = bytearray(HEADER.pack(VERSION, len(records)))
    for r in sorted(records, key=lambda r: r.tensor_index):
        out += RECORD.pack(r.tensor_index, r.method, r.domain, r.block_size, r.super_size, b"\0" * 6,
                           r.min_clip, r.max_clip)
    return bytes(out)


def decode_quant_info(data, *, path=None, base_offset: int = 0) -> list[QuantRecord]:
    data = bytes(data)
    n = len(data)
    if n < HEADER.size:
        raise TruncatedError("section too small", path=path, field="QuantInfo.header",
                             offset=base_offset, expected=f">= {HEADER.size} bytes", got=f"{n} bytes")
    version, count = HEADER.unpack_from(data, 0)
    if version != VERSION:
        raise UnsupportedVersionError("unsupported version", path=path, field="QuantInfo.version",
                                      offset=base_offset, expected=VERSION, got=version)
    if count > (n - HEADER.size) // RECORD.size:
        raise TruncatedError("record table runs past the section", path=path,
                             field="QuantInfo.record_count", offset=base_offset + 4,
                             expected=f"<= {(n - HEADER.size) // RECORD.size}", got=count)
    recs = np.frombuffer(data, dtype=_RECORD_DTYPE, count=count, offset=HEADER.size)
    out = []
    for i, r in enumerate(recs):
        if bytes(r["reserved"]) != b"\0" * 6:
            raise FormatError("reserved bytes are not zero", path=path,
                              field=f"QuantInfo.record[{i}].reserved",
                              offset=base_offset + HEADER.size + i * RECORD.size + 10)
        out.append(QuantRecord(int(r["tensor_index"]), int(r["method"]), int(r["domain"]),
                               int(r["block_size"]), int(r["super_size"]), float(r["min_clip"]),
                               float(r["max_clip"])))
    return out
