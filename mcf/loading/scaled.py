"""The read plan of a block-scaled weight (mxfp4, nvfp4, f8_e4m3_b128), wherever its bytes are: one payload of
an MCF file, or the separate tensors a safetensors checkpoint ships (gpt-oss's ``*_blocks`` and ``*_scales``,
DeepSeek's ``weight`` and ``weight_scale_inv``, ModelOpt's ``weight``, ``weight_scale`` and ``weight_scale_2``).

Those tensors hold, byte for byte, the regions of the MCF payload (:mod:`mcf._core.scaled`), so one plan serves
both: a piece's stages read the ranges of each region that make up a smaller payload of its rows (and columns,
on block boundaries) into staging, from whichever source holds that region, and the compiled decoder
(:mod:`mcf._core._mx`) writes the result.  The caller says where each region lies (``locate``).  An
f8_e4m3_b128 weight keeps one row of scales per 128 rows, so its stages start on a multiple of 128 and drop the
rows before the range after decoding; a column range off the block boundaries decodes whole rows and keeps its
columns.  Rank-3 expert stacks are cut along their first dimension (whole experts) or their last.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from mcf._core import _mx
from mcf._core.dtypes import DTypeInfo
from mcf._core.scaled import col_unit, payload_rows, row_unit, scaled_layout, scaled_slice
from mcf.errors import FormatError, InvalidArgumentError
from mcf.loading import plan as load_plan
from mcf.loading.dtypes import Element
from mcf.loading.plan import Piece, Stage

__all__ = ["scaled_piece"]


def scaled_piece(name: str, info: DTypeInfo, shape: tuple, cut, out: Element, locate: Callable, *, threads: int = 1,
                 what: str = "", on_error: Callable | None = None) -> Piece:
    """The piece ``cut`` (``(dim, start, stop)``, None: whole) of the block-scaled weight ``name`` of ``shape``,
    decoded to the float element ``out``.

    ``locate(region, offset) -> (source, file offset)``: where byte ``offset`` of region ``region`` ("scales",
    "data", "scale") of the weight's whole payload is.  ``on_error(exc)``: the error to raise for a
    :class:`mcf.FormatError` of the decoder (a NaN block scale), naming the file and tensor."""
    _, cols = payload_rows(info, shape)
    inner = math.prod(shape[1:-1])   # payload rows per index of the first dimension
    r0, r1, c0, c1 = 0, shape[0], 0, cols
    if cut is not None:
        if cut[0] == 0:
            r0, r1 = cut[1], cut[2]
        elif cut[0] == len(shape) - 1:
            c0, c1 = cut[1], cut[2]
        else:
            raise InvalidArgumentError(f"{what} is {info.name} of shape {list(shape)}: a piece along dimension "
                                       f"{cut[0]} cannot be read; slice dimension 0 or the last")
    cu, unit = col_unit(info), row_unit(info)
    aligned = c0 % cu == 0 and (c1 % cu == 0 or c1 == cols)
    lay = scaled_layout(info, shape)
    # payload rows per stage: their stored bytes, and the full-width float32 rows of a cropped or float64
    # decode, within the staging budget; a whole number of row units
    budget = load_plan.STAGING_BYTES
    per = max(1, budget // max(1, -(-lay.nbytes // max(1, lay.rows))))
    if not aligned or out.name == "F64" or unit > 1:
        per = max(1, min(per, budget // max(1, 4 * cols)))
    per = max(unit, per // unit * unit)
    stages = []
    source = None
    for a in range(r0 * inner, r1 * inner if c1 > c0 else r0 * inner, per):   # (no columns: nothing to decode)
        b = min(r1 * inner, a + per)
        start = a - a % unit
        mini, ranges = scaled_slice(info, shape, start, b, c0 if aligned else 0, c1 if aligned else cols)
        where = [locate(region, off) for region, off, _, _ in ranges]
        source = where[0][0]
        stages.append(Stage(np.array([o for _, o in where], np.int64), np.array([n for _, _, n, _ in ranges], np.int64),
                            np.array([d for _, _, _, d in ranges], np.int64), mini.nbytes,
                            _decoder(info, (mini.rows, mini.cols), a - r0 * inner, a - start, c0, c1, aligned,
                                     threads, on_error),
                            sources=[s for s, _ in where],
                            out_range=((a - r0 * inner) * (c1 - c0), (b - r0 * inner) * (c1 - c0))))
    if source is None:
        source = locate("data", 0)[0]
    return Piece(name, source, (r1 - r0,) + tuple(shape[1:-1]) + (c1 - c0,), out, stages=stages)


def _decoder(info, shape, first, skip, c0, c1, aligned, threads, on_error):
    """decode(staging, out): the mini payload of ``shape`` (its first ``skip`` rows decoded only to start on a
    row of scales) into payload rows ``first ..`` of ``out`` (columns ``c0:c1`` of full-width rows when the
    payload was not cut at them)."""
    rows = shape[0]

    def decode(staging, out):
        dest = out.reshape(-1, c1 - c0)[first:first + rows - skip]
        try:
            if aligned and not skip and dest.dtype != np.float64:
                _mx.dequantize(staging, info.code, shape, out=dest.reshape(-1), threads=threads)
                return
            tmp = _mx.dequantize(staging, info.code, shape, threads=threads,
                                 dtype=np.float32 if dest.dtype == np.float64 else dest.dtype)[skip:]
        except FormatError as exc:
            raise (on_error(exc) if on_error is not None else exc) from None
        dest[...] = tmp if aligned else tmp[:, c0:c1]

    return decode
