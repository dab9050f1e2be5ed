"""The read plan of an MCF tensor (:class:`mcf.loading.plan.Piece`): which bytes of the file make the
requested piece of it, and how they become the result.

Plain tensors are row-major arrays like safetensors', so they share the core's planning
(:func:`mcf.loading.plan.plain_piece`).  Quantized tensors have every row stored on its own in each
region (scales, sub-scales, codes; docs/mcf.md), so a row range, and a column range that starts and ends
on a block boundary (a super-block of 256 for k*), is a smaller payload of its own
(:func:`mcf.container.layout.quant_slice`): its ranges are read into staging and decoded by the compiled
kernels straight into the result, a bounded block of rows at a time.  A column range off those
boundaries reads its rows whole and keeps its columns after decoding.  An f8_e4m3_b128 tensor keeps one row
of scales per 128 rows, so a stage starts on a multiple of 128 and drops the rows before the range after
decoding.  mxfp4/nvfp4 tensors of rank 3 (expert stacks) are sliced along their first dimension (whole
experts) or their last (columns).
"""

from __future__ import annotations

import math

import numpy as np

from mcf.container.decode import decode_payload
from mcf.container.layout import payload_rows, quant_slice, row_unit
from mcf.container.reader import Container
from mcf.errors import DTypeError, FormatError, InvalidArgumentError, in_tensor
from mcf.loading.dtypes import ELEMENTS, element_of_mcf
from mcf.loading import plan as load_plan
from mcf.loading.plan import Piece, Stage, plain_piece
from mcf.loading.slices import cut_of

__all__ = ["tensor_piece"]


def tensor_piece(c: Container, name: str, spec, dtype, *, threads: int = 1) -> Piece:
    """The piece of tensor ``name`` that ``spec`` (:class:`mcf.Rows`, :class:`mcf.Shard` or None) asks for.

    ``dtype``: None (quantized tensors decode to F32, plain ones keep theirs), ``"raw"`` (quantized
    tensors as their payload bytes, uint8) or a float element name (``"F16"``, ``"BF16"``, ``"F32"``,
    ``"F64"``) that every float and quantized tensor is cast to.  ``threads``: decoding threads."""
    t = c.info(name)
    what = f"{c.path}: tensor {name!r}"
    shape = tuple(t.shape)
    cut = cut_of(spec, shape, what)
    if not t.dtype.quantized:
        el = element_of_mcf(t.dtype.code)
        out = ELEMENTS[dtype] if dtype not in (None, "raw") and t.dtype.family == "float" else None
        return plain_piece(name, c.source, t.offset, shape, el, cut, out=out, what=what)
    if dtype == "raw":
        if cut is not None:
            raise InvalidArgumentError(f"{what} is quantized ({t.dtype.name}): its raw payload loads whole; "
                                       "ask for a float dtype to load a slice of it")
        return plain_piece(name, c.source, t.offset, (t.nbytes,), ELEMENTS["U8"], None, what=what)
    try:
        prows, cols = payload_rows(t.dtype, shape)
    except InvalidArgumentError as exc:
        raise DTypeError(f"{what}: {exc}") from None
    out = ELEMENTS[dtype or "F32"]
    inner = math.prod(shape[1:-1])   # payload rows per index of the first dimension (mxfp4/nvfp4 stacks)
    r0, r1, c0, c1 = 0, shape[0], 0, cols
    if cut is not None:
        if cut[0] == 0:
            r0, r1 = cut[1], cut[2]
        elif cut[0] == len(shape) - 1:
            c0, c1 = cut[1], cut[2]
        else:
            raise InvalidArgumentError(f"{what} is {t.dtype.name} of shape {list(shape)}: a piece along dimension "
                                       f"{cut[0]} cannot be read; slice dimension 0 or the last")
    lay = c.quant_layout(name)
    rec = c.quant_record(name)
    domain = rec.domain if rec else 0
    aligned = quant_slice(lay, 0, 0, c0, c1, domain=domain) is not None
    unit = row_unit(lay)   # a stage starts on a multiple of it (f8_e4m3_b128: 128), decoding a few rows more
    # rows per stage: their stored bytes, and the full-width float32 rows of a cropped or float64 decode,
    # each within the staging budget
    row_bytes = max(1, -(-lay.nbytes // max(1, prows)))
    budget = load_plan.STAGING_BYTES
    per = max(1, budget // row_bytes)
    if not aligned or out.name == "F64" or unit > 1:
        per = max(1, min(per, budget // max(1, 4 * cols)))
    per = max(unit, per // unit * unit)
    stages = []
    for a in range(r0 * inner, r1 * inner if c1 > c0 else r0 * inner, per):   # (no columns: nothing to decode)
        b = min(r1 * inner, a + per)
        start = a - a % unit
        mini, src, sizes, dst = quant_slice(lay, start, b, c0, c1, domain=domain) if aligned else \
            quant_slice(lay, start, b, 0, cols, domain=domain)
        stages.append(Stage(t.offset + np.asarray(src, np.int64), np.asarray(sizes, np.int64),
                            np.asarray(dst, np.int64), mini.nbytes,
                            _decoder(t.dtype, mini.rows, mini.cols, domain, a - r0 * inner, a - start, c0, c1,
                                     aligned, threads, c.path, name)))
    out_shape = (r1 - r0,) + tuple(shape[1:-1]) + (c1 - c0,)
    return Piece(name, c.source, out_shape, out, stages=stages)


def _decoder(info, rows, cols, domain, first, skip, c0, c1, aligned, threads, path, name):
    """decode(staging, out): the mini payload's ``rows`` (the first ``skip`` of them only decoded, to start on a
    row of scales) into payload rows ``first:first+rows-skip`` of ``out`` (columns ``c0:c1`` of full-width rows
    when the payload was not cut at them)."""

    def decode(staging, out):
        dest = out.reshape(-1, c1 - c0)[first:first + rows - skip]
        try:
            if aligned and not skip and dest.dtype != np.float64:
                decode_payload(staging, info, (rows, cols), domain=domain, out=dest.reshape(-1), threads=threads)
                return
            tmp = decode_payload(staging, info, (rows, cols), domain=domain, threads=threads,
                                 dtype=np.float32 if dest.dtype == np.float64 else dest.dtype)[skip:]
        except FormatError as exc:   # a NaN block scale: which file, which tensor
            raise in_tensor(exc, path, name) from None
        dest[...] = tmp if aligned else tmp[:, c0:c1]

    return decode
