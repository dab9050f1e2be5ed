"""The read plan of an MCF tensor (:class:`mcf.loading.plan.Piece`): which bytes of the file make the
requested piece of it, and how they become the result.

Plain tensors are row-major arrays like safetensors', so they share the core's planning
(:func:`mcf.loading.plan.plain_piece`).  Quantized tensors are rank 2 with every row stored on its own
in each region (scales, sub-scales, codes; docs/mcf.md), so a row range, and a column range that starts
and ends on a block boundary (a super-block of 256 for k*), is a smaller payload of its own
(:func:`mcf.container.layout.quant_slice`): its ranges are read into staging and decoded by the compiled
kernels straight into the result, a bounded block of rows at a time.  A column range off those
boundaries reads its rows whole and keeps its columns after decoding.  The block-scaled extensions
(mxfp4, nvfp4, f8_e4m3_b128) share their plan with safetensors checkpoints: :mod:`mcf.loading.scaled`.
"""

from __future__ import annotations

import numpy as np

from mcf._core import _kernels
from mcf.container.layout import quant_slice
from mcf.container.reader import Container
from mcf.errors import DTypeError, InvalidArgumentError, in_tensor
from mcf.loading.dtypes import ELEMENTS, element_of_mcf
from mcf.loading import plan as load_plan
from mcf.loading.plan import Piece, Stage, plain_piece
from mcf.loading.scaled import scaled_piece
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
    if t.dtype.scaled:
        starts = {r.name: r.offset for r in c.quant_layout(name).regions}
        return scaled_piece(name, t.dtype, shape, cut, ELEMENTS[dtype or "F32"],
                            lambda region, off: (c.source, t.offset + starts[region] + off), threads=threads,
                            what=what, on_error=lambda exc: in_tensor(exc, c.path, name))
    if len(shape) != 2:
        raise DTypeError(f"{what}: quantized tensor of shape {shape}; expected 2 dimensions")
    out = ELEMENTS[dtype or "F32"]
    rows, cols = shape
    r0, r1, c0, c1 = 0, rows, 0, cols
    if cut is not None:
        if cut[0] == 0:
            r0, r1 = cut[1], cut[2]
        else:
            c0, c1 = cut[1], cut[2]
    lay = c.quant_layout(name)
    rec = c.quant_record(name)
    domain = rec.domain if rec else 0
    aligned = quant_slice(lay, 0, 0, c0, c1, domain=domain) is not None
    # rows per stage: their stored bytes, and the full-width float32 rows of a cropped or float64 decode,
    # each within the staging budget
    row_bytes = max(1, -(-lay.nbytes // max(1, rows)))
    budget = load_plan.STAGING_BYTES
    per = max(1, budget // row_bytes)
    if not aligned or out.name == "F64":
        per = max(1, min(per, budget // max(1, 4 * cols)))
    stages = []
    for a in range(r0, r1, per):
        b = min(r1, a + per)
        mini, src, sizes, dst = quant_slice(lay, a, b, c0, c1, domain=domain) if aligned else \
            quant_slice(lay, a, b, 0, cols, domain=domain)
        stages.append(Stage(t.offset + np.asarray(src, np.int64), np.asarray(sizes, np.int64),
                            np.asarray(dst, np.int64), mini.nbytes,
                            _decoder(t.dtype.code, mini.rows, mini.cols, domain, a - r0, c0, c1, aligned, threads),
                            out_range=((a - r0) * (c1 - c0), (b - r0) * (c1 - c0))))
    out_shape = (r1 - r0, c1 - c0)
    return Piece(name, c.source, out_shape, out, stages=stages)


def _decoder(code, rows, cols, domain, first, c0, c1, aligned, threads):
    """decode(staging, out): the mini payload's ``rows`` into rows ``first:first+rows`` of ``out``
    (columns ``c0:c1`` of full-width rows when the payload was not cut at them)."""

    def decode(staging, out):
        dest = out[first:first + rows]
        if aligned and dest.dtype != np.float64:
            _kernels.dequantize(staging, code, rows, cols, domain=domain, out=dest.reshape(-1), threads=threads)
            return
        tmp = _kernels.dequantize(staging, code, rows, cols, domain=domain,
                                  dtype=np.float32 if dest.dtype == np.float64 else dest.dtype, threads=threads)
        dest[...] = tmp if aligned else tmp[:, c0:c1]

    return decode
