"""The byte layout of MCF's block-quantized dtypes (q8/q4, k6/k4/k3/k2, int8/int4): the regions of a
payload (the spec's structure-of-arrays layout) and how a piece of one is cut out.  The block-scaled
extensions (mxfp4, nvfp4, f8_e4m3_b128) have theirs in :mod:`mcf._core.scaled`; :func:`quant_layout` answers
for both.

Core, below the MCF format: the compiled kernels (:mod:`mcf._core._kernels`) size their buffers from it and
:mod:`mcf.container.layout`, the format's one place for offsets and sizes, re-exports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mcf._core.dtypes import DTypeInfo, parse_dtype, plain_nbytes
from mcf._core.scaled import SCALE_BLOCK, scaled_layout, scaled_slice
from mcf.errors import InvalidArgumentError, UnknownNameError

__all__ = ["BLOCK", "SUPER_BLOCKS", "Domain", "QuantLayout", "Region", "align64", "quant_layout", "quant_slice",
           "shape_elements", "tensor_nbytes"]


class Domain(enum.IntEnum):
    WEIGHTS = 0       # symmetric, zero point 0
    ACTIVATIONS = 1   # asymmetric, zero point stored (int* only)


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


def _scaled_layout(info: DTypeInfo, shape) -> QuantLayout:
    """The block-scaled extensions' layout (:mod:`mcf._core.scaled` computes it) as a QuantLayout."""
    sl = scaled_layout(info, shape)
    block = SCALE_BLOCK[info.family]
    block_bytes = 0 if info.family == "fp8block" else block // 2
    row_bytes = sl.cols if info.family == "fp8block" else sl.cols // 2
    return QuantLayout(info, sl.rows, sl.cols, sl.blocks_per_row, 0, block_bytes, row_bytes,
                       tuple(Region(*r) for r in sl.regions), sl.nbytes)


def quant_layout(dtype, shape, domain: int = Domain.WEIGHTS) -> QuantLayout:
    """Regions of a quantized rank-2 tensor's payload (the spec's structure-of-arrays layout).

    q*: ``f16 scales[TB]`` -> align64 -> ``codes[TB * block_bytes]``
    k*: ``f16 super[TS]`` -> align64 -> [``f16 super_mins[TS]`` -> align64, activations only]
        -> ``u8 sub[TB]`` -> align64 -> codes
    int*: ``f32 scale`` -> align64 -> [``f32 zero`` -> align64, activations only] -> codes, each row
        packed separately (``cols`` bytes for int8, ``ceil(cols/2)`` for int4) so row ranges can be read.
    mxfp4, nvfp4, f8_e4m3_b128: see :mod:`mcf._core.scaled`.
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
    return BLOCK * (SUPER_BLOCKS if fam == "super" else 1)


def quant_slice(lay: QuantLayout, r0: int, r1: int, c0: int, c1: int, *, domain: int = Domain.WEIGHTS):
    """Rows ``r0:r1`` and columns ``c0:c1`` of a quantized payload as a payload of their own:
    ``(layout, src, sizes, dst)``, the ranges of the original (``src``, relative to the tensor's data)
    that make up the smaller payload of ``layout`` (at ``dst``; ``domain`` is the tensor's), or None when
    ``c0``/``c1`` do not fall where the payload can be cut (a block for q*, a super-block of 256 for k*, an even
    column for int4, a scale block for the extensions; the last column always can), or, for f8_e4m3_b128, when
    ``r0`` is not a multiple of 128 (its rows of scales cover 128 rows each: :func:`mcf._core.scaled.scaled_slice`).

    Rows are independent in every layout (each region holds its rows one after the other), so a row
    range is one range per region; a column range is one range per row and region.  The per-tensor
    scale (and zero point) of int8/int4 is copied whole."""
    rows, cols = lay.rows, lay.cols
    if lay.dtype.scaled:
        got = scaled_slice(lay.dtype, (rows, cols), r0, r1, c0, c1)
        if got is None:
            return None
        mini = quant_layout(lay.dtype, (r1 - r0, c1 - c0))
        return (mini, [lay.region(n).offset + o for n, o, _, _ in got[1]], [k for _, _, k, _ in got[1]],
                [d for _, _, _, d in got[1]])
    unit = _col_unit(lay)
    if not (0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= cols):
        raise InvalidArgumentError(f"rows {r0}:{r1}, columns {c0}:{c1} outside a {rows} x {cols} payload")
    if c0 % unit or (c1 % unit and c1 != cols):
        return None
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
            first = c0 * lay.dtype.bits // 8 if lay.dtype.family == "raw" else c0 // BLOCK * lay.block_bytes
            per_row(region, new, lay.row_bytes, first, mini.row_bytes)
        elif region.name == "super_scales":     # one per super-block
            per_row(region, new, lay.supers_per_row, c0 // (BLOCK * SUPER_BLOCKS), mini.supers_per_row)
        else:                                   # scales, sub_scales: one per block
            per_row(region, new, lay.blocks_per_row, c0 // BLOCK, mini.blocks_per_row)
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
