"""The byte layout of mcf's block-scaled extension dtypes (mxfp4, nvfp4, f8_e4m3_b128; docs/mcf.md, "mcf
extensions"): the one place that computes their regions and how a piece of one is cut out.

Their regions hold, byte for byte, the tensors the checkpoints that use these formats ship, so the same
arithmetic describes an MCF payload and a safetensors checkpoint's separate tensors:

- mxfp4 (OCP MX, gpt-oss): ``u8 e8m0_scales[TB]`` -> align64 -> ``data[TB * 16]``: blocks of 32 E2M1 values
  along each row, element 2k in the low nibble of byte k (gpt-oss's ``*_scales`` and ``*_blocks``);
- nvfp4 (NVIDIA ModelOpt): ``f32 scale`` (per tensor) -> align64 -> ``u8 e4m3_scales[TB]`` -> align64 ->
  ``data[TB * 8]``: blocks of 16 values (``weight_scale_2``, ``weight_scale``, ``weight``);
- f8_e4m3_b128 (DeepSeek-V3): ``f32 scales[ceil(rows/128) * ceil(cols/128)]`` -> align64 -> ``data[rows * cols]``
  of E4M3 bytes, one scale per 128 x 128 block, the last row and column of blocks partial
  (``weight_scale_inv``, ``weight``).

``TB`` is the number of blocks: ``rows * cols / block``.  Rows are every dimension but the last (mxfp4 and
nvfp4 may have any rank from 2: an expert stack ``[E, out, in]``); the last dimension must be a whole number
of blocks for them.  This module is core, below the MCF format (:mod:`mcf.container.layout` wraps it) and the
safetensors reader, which both describe these payloads.
"""

from __future__ import annotations

from typing import NamedTuple

from mcf._core.dtypes import DTypeInfo
from mcf.errors import InvalidArgumentError

import numpy as np

__all__ = ["SCALE_BLOCK", "ScaledLayout", "payload_rows", "scaled_layout", "scaled_slice", "row_unit", "col_unit",
           "nan_scales"]

#: values per scale: along a row for mxfp4 / nvfp4, a square of 128 x 128 for f8_e4m3_b128
SCALE_BLOCK = {"mxfp4": 32, "nvfp4": 16, "fp8block": 128}


def _align64(x: int) -> int:
    return (x + 63) & ~63


class ScaledLayout(NamedTuple):
    """The regions of one payload: ``(name, offset, size, numpy dtype, count)`` each, in order."""

    rows: int
    cols: int
    blocks_per_row: int     # scales per row (f8_e4m3_b128: per row of scales)
    regions: tuple
    nbytes: int

    def region(self, name: str) -> tuple:
        return next(r for r in self.regions if r[0] == name)


def payload_rows(info: DTypeInfo, shape) -> tuple:
    """``(rows, cols)`` of a quantized payload of tensor ``shape``: its two dimensions, or for mxfp4/nvfp4,
    which may have any rank from 2, every dimension but the last as rows."""
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


def scaled_layout(info: DTypeInfo, shape) -> ScaledLayout:
    """The regions of a block-scaled payload of tensor ``shape`` (see the module docstring)."""
    rows, cols = payload_rows(info, shape)
    bs = SCALE_BLOCK[info.family]
    if info.family == "fp8block":
        bpr = -(-cols // bs)
        ns = -(-rows // bs) * bpr
        off = _align64(4 * ns)
        regions = (("scales", 0, 4 * ns, "<f4", ns), ("data", off, rows * cols, "u1", rows * cols))
        return ScaledLayout(rows, cols, bpr, regions, off + rows * cols)
    if cols % bs:
        raise InvalidArgumentError(f"{info.name} stores blocks of {bs} values along the last dimension; "
                                   f"{cols} is not a multiple of {bs}")
    bpr = cols // bs
    tb = rows * bpr
    regions = []
    off = 0
    if info.family == "nvfp4":
        regions.append(("scale", 0, 4, "<f4", 1))
        off = 64
    regions.append(("scales", off, tb, "u1", tb))
    off = _align64(off + tb)
    regions.append(("data", off, tb * bs // 2, "u1", tb * bs // 2))
    return ScaledLayout(rows, cols, bpr, tuple(regions), off + tb * bs // 2)


def row_unit(info: DTypeInfo) -> int:
    """Payload rows a piece must start on: 128 for f8_e4m3_b128 (a row of scales covers 128 rows), else 1."""
    return SCALE_BLOCK["fp8block"] if info.family == "fp8block" else 1


def col_unit(info: DTypeInfo) -> int:
    """Columns a piece can be cut at: one scale block."""
    return SCALE_BLOCK[info.family]


def scaled_slice(info: DTypeInfo, shape, r0: int, r1: int, c0: int, c1: int):
    """Payload rows ``r0:r1`` and columns ``c0:c1`` as a payload of their own: ``(mini, ranges)``, ``mini`` the
    :class:`ScaledLayout` of the smaller payload (rank 2) and ``ranges`` the ``(region, offset in that region,
    size, offset in the mini payload)`` that fill it; or None when the cut does not fall on the format's
    boundaries (``c0``, and ``c1`` unless it is the last column, a multiple of :func:`col_unit`; ``r0`` of
    :func:`row_unit`)."""
    lay = scaled_layout(info, shape)
    if not (0 <= r0 <= r1 <= lay.rows and 0 <= c0 <= c1 <= lay.cols):
        raise InvalidArgumentError(f"rows {r0}:{r1}, columns {c0}:{c1} outside a {lay.rows} x {lay.cols} payload")
    unit = col_unit(info)
    if c0 % unit or (c1 % unit and c1 != lay.cols) or r0 % row_unit(info):
        return None
    mini = scaled_layout(info, (r1 - r0, c1 - c0))
    ranges = []

    def per_row(name, stride, first, count, nrows, row0, item):
        """``count`` items from item ``first`` of rows ``row0 .. row0 + nrows`` (``stride`` items apart)."""
        new = mini.region(name)
        if nrows == 0 or count == 0:
            return
        if first == 0 and count == stride:   # whole rows: one range
            ranges.append((name, row0 * stride * item, nrows * stride * item, new[1]))
            return
        for k in range(nrows):
            ranges.append((name, ((row0 + k) * stride + first) * item, count * item, new[1] + k * count * item))

    n = r1 - r0
    if info.family == "fp8block":
        bs = SCALE_BLOCK["fp8block"]
        per_row("scales", lay.blocks_per_row, c0 // bs, mini.blocks_per_row, -(-n // bs), r0 // bs, 4)
        per_row("data", lay.cols, c0, c1 - c0, n, r0, 1)
        return mini, ranges
    if info.family == "nvfp4":
        ranges.append(("scale", 0, 4, 0))
    per_row("scales", lay.blocks_per_row, c0 // unit, mini.blocks_per_row, n, r0, 1)
    per_row("data", lay.cols // 2, c0 // 2, (c1 - c0) // 2, n, r0, 1)
    return mini, ranges


def nan_scales(info: DTypeInfo, region: str, raw) -> np.ndarray:
    """The indexes of the NaN scales among the bytes ``raw`` (a uint8 array, whole values) of region ``region``
    ("scales" or nvfp4's "scale"): E8M0 0xFF (mxfp4), E4M3 S.1111.111 (nvfp4), float32 NaN (f8_e4m3_b128 and
    the per-tensor scale).  A NaN scale makes every value of its block NaN."""
    raw = np.asarray(raw, np.uint8)
    if region == "scale" or info.family == "fp8block":
        return np.flatnonzero((raw.view("<u4") & 0x7FFFFFFF) > 0x7F800000)
    if info.family == "mxfp4":
        return np.flatnonzero(raw == 0xFF)
    return np.flatnonzero((raw & 0x7F) == 0x7F)
