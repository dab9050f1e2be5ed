"""The read plan of a GGUF tensor (:class:`mcf.loading.plan.Piece`), so that the loaders fill memory from a
GGUF file the way they fill it from an MCF or safetensors file.

Plain tensors (F32, F16, BF16, F64, I8..I64) are row-major arrays: the core plans them
(:func:`mcf.loading.plan.plain_piece`), read straight into the result or cast through staging.  Quantized
tensors (Q4_K, IQ2_XXS, MXFP4...) are read into staging a bounded number of rows (or blocks) at a time and
decoded by the compiled kernels (:mod:`mcf.gguf._gguf`, the decoder :meth:`GGUFFile.dequantize` uses)
straight into their part of the result.

``rows``: an optional row order, the stored row each row of the result is.  A GGUF row is a contiguous
range of the file (a whole number of blocks), so a reordering such as the un-permutation of llama's
Q/K rows that transformers applies to llama.cpp files costs nothing: each row is read into its place.
"""

from __future__ import annotations

import math

import numpy as np

from mcf.errors import DTypeError, InvalidArgumentError
from mcf.gguf import _gguf
from mcf.gguf.reader import SUPPORTED_TYPES, GGUFFile
from mcf.loading import plan as load_plan
from mcf.loading.dtypes import ELEMENTS, FLOAT_ELEMENTS
from mcf.loading.plan import Piece, Stage, cast_stages, plain_piece
from mcf.loading.slices import cut_of

__all__ = ["tensor_piece", "stored_element"]

def stored_element(g: GGUFFile, name: str):
    """The element a plain tensor is stored as, or None for a quantized one (which decodes to a float)."""
    t = g.info(name)
    return ELEMENTS[t.type.name] if t.type.kind in ("float", "int") else None


def tensor_piece(g: GGUFFile, name: str, spec, out: str | None, *, rows: np.ndarray | None = None,
                 threads: int = 1) -> Piece:
    """The piece of GGUF tensor ``name`` that ``spec`` (:class:`mcf.Rows`, :class:`mcf.Shard` or None) asks
    for, after ``rows`` (an int64 array: the stored row of each row of the tensor; None: as stored).

    ``out``: None (quantized tensors decode to F32, plain ones keep their type) or a float element name
    (``"F16"``, ``"BF16"``, ``"F32"``, ``"F64"``) that every float and quantized tensor is cast to.  A cut
    along a dimension other than the first is for plain tensors in stored row order only."""
    t = g.info(name)
    what = f"{g.path}: tensor {name!r}"
    shape = tuple(t.shape)
    if t.type.kind not in ("float", "int", "quant"):
        raise DTypeError(f"{what} has ggml type {t.type.name}, which mcf cannot decode (supported: "
                         f"{', '.join(SUPPORTED_TYPES)}, I8..I64)")
    cut = cut_of(spec, shape, what)
    if rows is not None and (len(shape) < 1 or rows.shape != (shape[0],)):
        raise AssertionError(f"{what}: a row order of {rows.shape} for shape {shape}")
    plain = t.type.kind != "quant"
    if plain and rows is None:
        el = ELEMENTS[t.type.name]
        to = ELEMENTS[out] if out is not None and t.type.kind == "float" else None
        return plain_piece(name, g.source, t.offset, shape, el, cut, out=to, what=what)
    if cut is not None and cut[0] != 0:
        raise InvalidArgumentError(f"{what}: a {t.type.name} tensor{' in a new row order' if plain else ''} is "
                                   "cut along its first dimension only")
    order = rows
    if cut is not None:
        order = (np.arange(cut[1], cut[2], dtype=np.int64) if order is None else order[cut[1]:cut[2]])
    out_shape = shape if cut is None else (cut[2] - cut[1],) + shape[1:]
    if plain:   # a new row order of a plain tensor: one range per row
        el = ELEMENTS[t.type.name]
        row = math.prod(shape[1:]) * el.itemsize
        offsets = t.offset + order.astype(np.int64) * row
        to = ELEMENTS[out] if out is not None and t.type.kind == "float" else el
        if to.name != el.name:
            stages = cast_stages(offsets, row, el.itemsize, el.name, to.itemsize) if offsets.shape[0] and row else []
            return Piece(name, g.source, out_shape, to, stages=stages)
        return Piece(name, g.source, out_shape, el, offsets=offsets if row else (), size=row)
    return _quant_piece(g, name, t, order, out_shape, ELEMENTS[out or "F32"], threads)


def _quant_piece(g, name, t, order, out_shape, out, threads) -> Piece:
    """Stages of a quantized tensor: units (rows when ``order`` is given, else blocks) read into staging a
    bounded number at a time and decoded into their span of the flat result."""
    typ = t.type
    if out.name not in FLOAT_ELEMENTS:
        raise AssertionError(f"_quant_piece: {out.name} is not a float element")
    if order is None:
        unit_vals, count = typ.block, t.n_elements // typ.block
    else:
        unit_vals, count = t.row_elements, order.shape[0]
    unit_bytes = unit_vals // typ.block * typ.size
    wide = out.name == "F64"   # decoded to float32 first
    # stored bytes and the values they decode to (plus float32 scratch for float64) within the staging budget
    unit_cost = unit_bytes + unit_vals * out.itemsize + (unit_vals * 4 if wide else 0)
    per = max(1, load_plan.STAGING_BYTES // max(1, unit_cost))
    stages = []
    for a in range(0, count, per):
        n = min(per, count - a)
        if order is None:
            offs, sizes = np.array([t.offset + a * unit_bytes], np.int64), np.array([n * unit_bytes], np.int64)
        else:
            src = order[a:a + n].astype(np.int64)
            if n > 1 and np.all(np.diff(src) == 1):   # consecutive rows: one range
                offs, sizes = np.array([t.offset + int(src[0]) * unit_bytes], np.int64), \
                    np.array([n * unit_bytes], np.int64)
            else:
                offs, sizes = t.offset + src * unit_bytes, np.full(n, unit_bytes, np.int64)
        stages.append(Stage(offs, sizes, None, n * unit_bytes,
                            _decoder(typ.code, n * unit_vals, typ.block, wide, threads),
                            (a * unit_vals, n * unit_vals)))
    return Piece(name, g.source, tuple(out_shape), out, stages=stages)


def _decoder(code, nvals, block, wide, threads):
    """decode(staging, dest): ``nvals`` values of the staged blocks into ``dest``, their span of the flat result."""

    def decode(staging, dest):
        if wide:
            tmp = np.empty(nvals, np.float32)
            _gguf.dequantize_blocks(staging, code, nvals // block, tmp, threads=threads)
            dest[...] = tmp
        else:
            _gguf.dequantize_blocks(staging, code, nvals // block, dest, threads=threads)

    return decode
