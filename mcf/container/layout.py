"""MCF byte layouts: header, section directory, section types and quantized payload regions.

Reader and writer both take every offset and size from here, so they cannot disagree.  The numbers
are those of the MCF spec (seed 002) and of the Go reference writer (samcharles93/mantle ``pkg/mcf``);
see docs/mcf.md for the decisions where the spec is silent.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from mcf._core.dtypes import DType, DTypeInfo, parse_dtype, plain_nbytes
from mcf.errors import InvalidArgumentError, UnknownNameError

__all__ = [
    "MAGIC", "MAJOR", "MINOR", "HEADER", "HEADER_SIZE", "DIR_ENTRY", "DIR_ENTRY_SIZE",
    "FLAG_TENSOR_DATA_ALIGNED64", "SectionType", "RESOURCE_FILES", "align", "align64",
    "QuantLayout", "Region", "quant_layout", "tensor_nbytes", "MAX_RANK", "Domain", "quant_slice", "row_unit",
    "payload_rows", "SCALE_BLOCK",
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


class Domain(enum.IntEnum):
    WEIGHTS = 0       # symmetric, zero point 0
    ACTIVATIONS = 1   # asymmetric, zero point stored (int* only)


def align(x: int, a: int) -> int:
    if a <= 1:
        return x
    return (x + a - 1) // a * a


def align64(x: int) -> int:
    return (x + 63) & ~63


def shape_elements(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class Region:
    """One sub-region of a quantized payload, relative to the tensor's data offset."""

    name: str      # "scale", "zero", "scales", "super_scales", "sub_scales", "data"
    offset: int
    size: int
    dtype: str     # numpy dtype string of its items ("<f2", "u1", "<f4")
    count: int     # number of items


@dataclass(frozen=True)
class QuantLayout:
    dtype: DTypeInfo
    rows: int               # the payload's rows: every dimension but the last (a rank-2 tensor's shape[0])
    cols: int
    blocks_per_row: int
    supers_per_row: int
    block_bytes: int        # bytes of packed codes per 32-value block (0 for int*)
    row_bytes: int          # bytes of packed codes per row
    regions: tuple[Region, ...]
    nbytes: int             # total payload size

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise UnknownNameError(f"no region {name!r} in this layout; it has {[r.name for r in self.regions]}")


BLOCK = 32          # values per block (q* and k*)
SUPER_BLOCKS = 8    # blocks per super-block (k*: 256 values)
#: values per scale of the block-scaled extensions: along a row for mxfp4/nvfp4, a square for f8_e4m3_b128
SCALE_BLOCK = {"mxfp4": 32, "nvfp4": 16, "fp8block": 128}


def payload_rows(info: DTypeInfo, shape) -> tuple:
    """``(rows, cols)`` of a quantized tensor's payload: its two dimensions, or for mxfp4/nvfp4, which
    may have any rank from 2 (an expert stack [E, out, in]), every dimension but the last as rows."""
    shape = tuple(int(d) for d in shape)
    multi = info.family in ("mxfp4", "nvfp4")
    if len(shape) != 2 and not (multi and len(shape) > 2):
        raise InvalidArgumentError(f"{info.name} tensors are {'rank 2 or more' if multi else 'rank 2'}; "
                                   f"got shape {shape}")
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"negative dimension in {shape}")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


def _scaled_layout(info: DTypeInfo, shape) -> QuantLayout:
    """The extension formats (docs/mcf.md, "mcf extensions"), each row's blocks stored one after the other:

    mxfp4: ``u8 e8m0_scales[TB]`` -> align64 -> ``data[TB * 16]`` (32 E2M1 values per block, two per byte,
        element 2k in the low nibble of byte k): the bytes of gpt-oss's ``*_scales`` and ``*_blocks``;
    nvfp4: ``f32 scale`` (the tensor's) -> align64 -> ``u8 e4m3_scales[TB]`` -> align64 -> ``data[TB * 8]``
        (16 values per block): ModelOpt's ``weight_scale_2``, ``weight_scale`` and ``weight``;
    f8_e4m3_b128: ``f32 scales[ceil(rows/128) * ceil(cols/128)]`` -> align64 -> ``data[rows * cols]`` (E4M3):
        DeepSeek-V3's ``weight_scale_inv`` and ``weight``.
    """
    rows, cols = payload_rows(info, shape)
    bs = SCALE_BLOCK[info.family]
    regions = []
    if info.family == "fp8block":
        ns = -(-rows // bs) * -(-cols // bs)
        regions.append(Region("scales", 0, 4 * ns, "<f4", ns))
        off = align64(4 * ns)
        regions.append(Region("data", off, rows * cols, "u1", rows * cols))
        return QuantLayout(info, rows, cols, -(-cols // bs), 0, 0, cols, tuple(regions), off + rows * cols)
    if cols % bs:
        raise InvalidArgumentError(f"{info.name} stores blocks of {bs} values along the last dimension; "
                                   f"{cols} is not a multiple of {bs}")
    bpr = cols // bs
    tb = rows * bpr
    off = 0
    if info.family == "nvfp4":
        regions.append(Region("scale", 0, 4, "<f4", 1))
        off = 64
    regions.append(Region("scales", off, tb, "u1", tb))
    off = align64(off + tb)
    regions.append(Region("data", off, tb * bs // 2, "u1", tb * bs // 2))
    return QuantLayout(info, rows, cols, bpr, 0, bs // 2, cols // 2, tuple(regions), off + tb * bs // 2)


def quant_layout(dtype, shape, domain: int = Domain.WEIGHTS) -> QuantLayout:
    """Regions of a quantized rank-2 tensor's payload (the spec's structure-of-arrays layout).

    q*: ``f16 scales[TB]`` -> align64 -> ``codes[TB * block_bytes]``
    k*: ``f16 super[TS]`` -> align64 -> [``f16 super_mins[TS]`` -> align64, activations only]
        -> ``u8 sub[TB]`` -> align64 -> codes
    int*: ``f32 scale`` -> align64 -> [``f32 zero`` -> align64, activations only] -> codes, each row
        packed separately (``cols`` bytes for int8, ``ceil(cols/2)`` for int4) so row ranges can be read.
    mxfp4, nvfp4, f8_e4m3_b128: see :func:`_scaled_layout`.
    """
    info = parse_dtype(dtype)
    if not info.quantized:
        raise InvalidArgumentError(f"{info.name} is not a quantized dtype")
    if info.scaled:
        if int(domain) != Domain.WEIGHTS:
            raise InvalidArgumentError(f"{info.name} supports only the weights domain")
        return _scaled_layout(info, shape)
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2:
        raise InvalidArgumentError(f"quantized tensors are rank 2; got shape {shape}")
    rows, cols = shape
    if rows < 0 or cols < 0:
        raise InvalidArgumentError(f"negative dimension in {shape}")
    domain = int(domain)
    regions = []
    if info.family == "raw":
        row_bytes = cols if info.bits == 8 else (cols + 1) // 2
        off = 0
        regions.append(Region("scale", 0, 4, "<f4", 1))
        off = align64(4)
        if domain == Domain.ACTIVATIONS:
            regions.append(Region("zero", off, 4, "<f4", 1))
            off = align64(off + 4)
        data = rows * row_bytes
        regions.append(Region("data", off, data, "u1", data))
        return QuantLayout(info, rows, cols, 0, 0, 0, row_bytes, tuple(regions), off + data)
    if domain != Domain.WEIGHTS:
        raise InvalidArgumentError(f"{info.name} supports only the weights domain")
    bpr = (cols + BLOCK - 1) // BLOCK
    spr = (bpr + SUPER_BLOCKS - 1) // SUPER_BLOCKS
    tb = rows * bpr
    ts = rows * spr
    block_bytes = BLOCK * info.bits // 8
    data = tb * block_bytes
    if info.family == "block":
        regions.append(Region("scales", 0, 2 * tb, "<f2", tb))
        off = align64(2 * tb)
    else:
        regions.append(Region("super_scales", 0, 2 * ts, "<f2", ts))
        off = align64(2 * ts)
        regions.append(Region("sub_scales", off, tb, "u1", tb))
        off = align64(off + tb)
    regions.append(Region("data", off, data, "u1", data))
    return QuantLayout(info, rows, cols, bpr, spr, block_bytes, bpr * block_bytes, tuple(regions),
                       off + data)


def _col_unit(lay: QuantLayout) -> int:
    """Columns a payload can be cut at without splitting what one stored value covers: a block (q*),
    a super-block (k*: its scale covers 8 blocks), a byte (int4: two columns), one column (int8)."""
    fam = lay.dtype.family
    if fam == "raw":
        return 1 if lay.dtype.bits == 8 else 2
    if fam in SCALE_BLOCK:
        return SCALE_BLOCK[fam]
    return BLOCK * (SUPER_BLOCKS if fam == "super" else 1)


def row_unit(lay: QuantLayout) -> int:
    """Payload rows a slice must start on: 128 for f8_e4m3_b128 (a row of scales covers 128 rows), else 1."""
    return SCALE_BLOCK["fp8block"] if lay.dtype.family == "fp8block" else 1


def quant_slice(lay: QuantLayout, r0: int, r1: int, c0: int, c1: int, *, domain: int = Domain.WEIGHTS):
    """Rows ``r0:r1`` and columns ``c0:c1`` of a quantized payload as a payload of their own:
    ``(layout, src, sizes, dst)``, the ranges of the original (``src``, relative to the tensor's data)
    that make up the smaller payload of ``layout`` (at ``dst``; ``domain`` is the tensor's), or None when ``c0``/``c1`` do not fall
    where the payload can be cut (a block for q*, a super-block of 256 for k*, an even column for int4,
    a scale block for the extensions; the last column always can), or, for f8_e4m3_b128, when ``r0`` is not a
    multiple of 128 (its rows of scales cover 128 rows each).

    Rows are independent in every layout (each region holds its rows one after the other), so a row
    range is one range per region; a column range is one range per row and region.  The per-tensor
    scale (and zero point) of int8/int4 is copied whole."""
    rows, cols = lay.rows, lay.cols
    unit = _col_unit(lay)
    if not (0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= cols):
        raise InvalidArgumentError(f"rows {r0}:{r1}, columns {c0}:{c1} outside a {rows} x {cols} payload")
    if c0 % unit or (c1 % unit and c1 != cols) or r0 % row_unit(lay):
        return None
    if lay.dtype.family == "fp8block":
        return _fp8block_slice(lay, r0, r1, c0, c1)
    mini = quant_layout(lay.dtype, (r1 - r0, c1 - c0), domain=domain)
    n = r1 - r0
    src, sizes, dst = [], [], []

    def per_row(region, new, stride, first, count):
        """``count`` items from item ``first`` of each row, rows ``stride`` items apart."""
        if n == 0 or count == 0:
            return
        item = region.size // region.count if region.count else 1
        if first == 0 and count == stride:   # whole rows: one range
            src.append(region.offset + r0 * stride * item)
            sizes.append(n * stride * item)
            dst.append(new.offset)
            return
        for k in range(n):
            src.append(region.offset + ((r0 + k) * stride + first) * item)
            sizes.append(count * item)
            dst.append(new.offset + k * count * item)

    for region, new in zip(lay.regions, mini.regions):
        if region.name in ("scale", "zero"):   # int8/int4: one value per tensor
            src.append(region.offset)
            sizes.append(region.size)
            dst.append(new.offset)
        elif region.name == "data":            # bytes, rows of row_bytes
            first = c0 * lay.dtype.bits // 8 if lay.dtype.family in ("raw", "mxfp4", "nvfp4") \
                else c0 // BLOCK * lay.block_bytes
            per_row(region, new, lay.row_bytes, first, mini.row_bytes)
        elif region.name == "super_scales":     # one per super-block
            per_row(region, new, lay.supers_per_row, c0 // (BLOCK * SUPER_BLOCKS), mini.supers_per_row)
        else:                                   # scales, sub_scales: one per block
            per_row(region, new, lay.blocks_per_row, c0 // _col_unit(lay) if lay.dtype.scaled else c0 // BLOCK,
                    mini.blocks_per_row)
    return mini, src, sizes, dst


def _fp8block_slice(lay: QuantLayout, r0: int, r1: int, c0: int, c1: int):
    """quant_slice of an f8_e4m3_b128 payload (``r0`` and ``c0`` on block boundaries): the scale rows
    ``r0/128 .. ceil(r1/128)`` (their columns ``c0/128 ..``), then the data rows."""
    bs = SCALE_BLOCK["fp8block"]
    mini = quant_layout(lay.dtype, (r1 - r0, c1 - c0))
    scales, data = lay.region("scales"), lay.region("data")
    mscales, mdata = mini.region("scales"), mini.region("data")
    src, sizes, dst = [], [], []
    n_sr, n_sc = -(-(r1 - r0) // bs), mini.blocks_per_row
    for k in range(n_sr if c1 > c0 else 0):
        src.append(scales.offset + 4 * ((r0 // bs + k) * lay.blocks_per_row + c0 // bs))
        sizes.append(4 * n_sc)
        dst.append(mscales.offset + 4 * k * n_sc)
    if c0 == 0 and c1 == lay.cols:
        if r1 > r0 and lay.cols:
            src.append(data.offset + r0 * lay.cols)
            sizes.append((r1 - r0) * lay.cols)
            dst.append(mdata.offset)
    elif c1 > c0:
        for k in range(r1 - r0):
            src.append(data.offset + (r0 + k) * lay.cols + c0)
            sizes.append(c1 - c0)
            dst.append(mdata.offset + k * (c1 - c0))
    return mini, src, sizes, dst


def tensor_nbytes(dtype, shape, *, domain: int = Domain.WEIGHTS) -> int:
    """Exact payload size of a tensor of ``dtype`` and ``shape`` (Python ints: no overflow)."""
    info = parse_dtype(dtype)
    if info.quantized:
        return quant_layout(info, shape, domain=domain).nbytes
    n = plain_nbytes(info, shape_elements(shape))
    if n is None:
        raise InvalidArgumentError(f"{info.name} packs two values per byte: shape {list(shape)} holds an odd "
                                   "number of values")
    return n


def is_quantized(code: int) -> bool:
    return parse_dtype(code).quantized


_ = DType  # re-exported for convenience
