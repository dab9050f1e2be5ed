"""MCF byte layouts: header, section directory, section types and quantized payload regions.

Reader and writer both take every offset and size from here, so they cannot disagree.  The quantized
payloads' regions are computed in the core (:mod:`mcf._core.block_layout`, which the compiled kernels use
too) and re-exported here.  The numbers
are those of the MCF spec (seed 002) and of the Go reference writer (samcharles93/mantle ``pkg/mcf``);
see docs/mcf.md for the decisions where the spec is silent.
"""

from __future__ import annotations

import enum
import struct

from mcf._core.block_layout import (BLOCK, SUPER_BLOCKS, Domain, QuantLayout, Region, align64, quant_layout,
                                    quant_slice, shape_elements, tensor_nbytes)
from mcf._core.dtypes import DType, parse_dtype

__all__ = [
    "MAGIC", "MAJOR", "MINOR", "HEADER", "HEADER_SIZE", "DIR_ENTRY", "DIR_ENTRY_SIZE",
    "FLAG_TENSOR_DATA_ALIGNED64", "SectionType", "RESOURCE_FILES", "align", "align64",
    "QuantLayout", "Region", "quant_layout", "tensor_nbytes", "MAX_RANK", "Domain", "quant_slice",
]

MAGIC = b"MCF\x00"
MAJOR = 1
MINOR = 1

# magic, major, minor, header_size, section_count, section_dir_offset, file_size, flags
HEADER = struct.Struct("<4sHHIIQQQ")
HEADER_SIZE = HEADER.size  # 40
assert HEADER_SIZE == 40

# type, version, offset, size
DIR_ENTRY = struct.Struct("<IIQQ")
DIR_ENTRY_SIZE = DIR_ENTRY.size  # 24

FLAG_TENSOR_DATA_ALIGNED64 = 1 << 0

SECTION_ALIGN = 8        # every section starts on an 8-byte boundary
TENSOR_ALIGN = 64        # default alignment of each tensor's data (absolute file offset)
MAX_RANK = 16            # readers refuse more; no model format in use needs more than 8
MAX_SECTIONS = 1 << 16   # a directory larger than this is treated as corrupt


class SectionType(enum.IntEnum):
    MODEL_INFO = 0x0001
    QUANT_INFO = 0x0002
    TENSOR_INDEX = 0x0003
    TENSOR_DATA = 0x0004
    HF_CONFIG_JSON = 0x0100
    HF_GENERATION_CONFIG_JSON = 0x0101
    TOKENIZER_JSON = 0x0102
    TOKENIZER_CONFIG_JSON = 0x0103
    VOCAB_JSON = 0x0104
    MERGES_TXT = 0x0105


# Resource sections and the checkpoint file each one holds, in the order the Go packer writes them
# (vocab.json before tokenizer_config.json).
RESOURCE_FILES = {
    SectionType.HF_CONFIG_JSON: "config.json",
    SectionType.HF_GENERATION_CONFIG_JSON: "generation_config.json",
    SectionType.TOKENIZER_JSON: "tokenizer.json",
    SectionType.VOCAB_JSON: "vocab.json",
    SectionType.TOKENIZER_CONFIG_JSON: "tokenizer_config.json",
    SectionType.MERGES_TXT: "merges.txt",
}
RESOURCE_BY_FILE = {v: k for k, v in RESOURCE_FILES.items()}

SECTION_NAMES = {
    SectionType.MODEL_INFO: "ModelInfo",
    SectionType.QUANT_INFO: "QuantInfo",
    SectionType.TENSOR_INDEX: "TensorIndex",
    SectionType.TENSOR_DATA: "TensorData",
    **{k: v for k, v in RESOURCE_FILES.items()},
}


def section_name(code: int) -> str:
    try:
        return SECTION_NAMES[SectionType(code)]
    except ValueError:
        return f"unknown(0x{code:04x})"


def align(x: int, a: int) -> int:
    if a <= 1:
        return x
    return (x + a - 1) // a * a


def is_quantized(code: int) -> bool:
    return parse_dtype(code).quantized


_ = (DType, BLOCK, SUPER_BLOCKS, shape_elements)  # re-exported: the format's layout names them
