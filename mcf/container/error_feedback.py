"""Codes chosen with error feedback through the second moment of a layer's inputs (GPTQ's method).

Why: a linear layer ``y = x @ W.T`` turns a weight error ``dW`` into the output error ``x @ dW.T``, whose mean
square over the inputs is ``trace(dW H dW^T)`` with ``H = E[x x^T]``, the second moment of the inputs.  An
importance vector (:mod:`mcf.conversion.imatrix`) keeps only the diagonal of ``H``: it can choose each block's scale,
but
the codes stay each value rounded to its nearest step.  With the whole matrix the codes themselves can
cancel each other's error along the directions the inputs actually take: GPTQ (Frantar et al., 2022) rounds
the columns one after the other and spreads each column's rounding error over the columns not yet rounded,
through the upper Cholesky factor ``U`` of ``H^-1`` (``H`` damped by 1% of its mean diagonal):

    for each column j:  q_j = round(w_j);  e = (w_j - q_j) / U[j, j];  w_k -= e * U[j, k]  for k > j

Each update is the change of the columns not yet rounded that minimises ``trace(dW H dW^T)`` given the
columns rounded so far (the Optimal Brain Surgeon step); on MiniLM the (1 - cosine) of sentence embeddings
falls by about a third against the search's nearest rounding, twice what the importance vector alone gives
(docs/quantization.md).  The file format does not change: the scales are those of the search quantizer
weighted by ``diag(H)`` (the same code, the same bytes), only the codes differ, and the decoder returns
``scale * code`` for them as for any other payload.

Choices, and why:

- float64 throughout (``H``, its factor, the running weights): ``H^-1`` of a damped second moment can have a
  condition number of 10^4 and more, and the running weights accumulate thousands of updates; float32 would
  make the codes depend on summation order far more often.  The cost is memory (``cols^2`` float64 for ``U``)
  and half of float32's BLAS speed.
- Lazy batches of 128 columns (GPTQ's): inside a batch the updates touch only the batch; the rest of the row
  is updated once per batch with one matrix product, so large layers run at BLAS speed.  Rows are independent
  (the same ``U`` for every row) and are processed in chunks that bound the memory.
- Each code is rounded the way the search quantizer rounds: ``clamp(rint(float32(w) * (1 / scale)), qmin, qmax)``
  in float32 with the scale the decoder reads, over the whole code range (docs/mcf.md: writers other than the
  mantle-compatible one may emit the most negative code); a block whose scale is 0 gets code 0.  So
  with ``H`` a multiple of the identity (no feedback) the payload is byte-identical to the search's.
"""

from __future__ import annotations

import numpy as np

from mcf._core import _kernels
from mcf._core.args import reals
from mcf._core.dtypes import DTypeInfo
from mcf.errors import InvalidArgumentError
from mcf.container.layout import quant_layout

__all__ = ["DAMPING", "BATCH_COLUMNS", "check_second_moment", "feedback_factor", "block_scales",
           "feedback_codes", "requantize_codes"]

DAMPING = 0.01          # of the mean diagonal, added to the diagonal (GPTQ's default percdamp)
BATCH_COLUMNS = 128     # columns updated together before the rest of the row (GPTQ's blocksize)
_CHUNK_BYTES = 64 << 20  # float64 working rows per step, at most
_CHUNK_ROWS = 256        # rows per step, at most: steps for threads=, whatever their number
_SYMMETRY_TOLERANCE = 1e-5  # of max|H|: float32 sums of x x^T computed by a GEMM are symmetric to ~1e-7
_TILE = 256  # rows and columns of the tiles the symmetry check compares (two fit in L2)


def check_second_moment(h, shape: tuple) -> np.ndarray:
    """``h`` as a finite symmetric float64 ``[cols, cols]`` matrix (made exactly symmetric) for a tensor of
    ``shape`` ``(rows, cols)``, or :class:`mcf.InvalidArgumentError` saying what is wrong with it."""
    m = reals(h, "second_moment")
    cols = shape[1]
    if m.ndim != 2 or m.shape != (cols, cols):
        raise InvalidArgumentError(f"second_moment has shape {m.shape}; the tensor has shape {tuple(shape)}, so a "
                                   f"({cols}, {cols}) matrix (the second moment of its inputs) is needed")
    if not np.isfinite(m).all():
        i, j = (int(v) for v in np.argwhere(~np.isfinite(m))[0])
        raise InvalidArgumentError(f"second_moment[{i}, {j}] = {float(m[i, j])!r}; its values must be finite")
    m = np.asarray(m, dtype=np.float64)
    top = float(np.abs(m).max()) if m.size else 0.0
    d = np.diagonal(m)
    if cols and (d < 0).any():
        i = int(np.flatnonzero(d < 0)[0])
        raise InvalidArgumentError(f"second_moment[{i}, {i}] = {float(d[i])!r}; a second moment's diagonal (the mean "
                                   "squared input of each column) is >= 0")
    # only the matrix's shape matters, not its size: bring max|H| near 1 by a power of 4, which changes no
    # code (every step below is exact under it: Cholesky halves the exponent) and keeps the mean, the
    # damping and the factor of values near the float64 limits finite
    scale = np.ldexp(1.0, -2 * (int(np.frexp(top)[1]) // 2)) if top else 1.0
    out = np.empty_like(m)
    # checked and made symmetric tile by tile: a whole-matrix m - m.T walks one operand column-wise, which
    # took seconds for 4096 x 4096
    for i0 in range(0, cols, _TILE):
        i1 = min(cols, i0 + _TILE)
        for j0 in range(i0, cols, _TILE):
            j1 = min(cols, j0 + _TILE)
            a, b = m[i0:i1, j0:j1] * scale, m[j0:j1, i0:i1].T * scale
            asym = np.abs(a - b)
            if float(asym.max()) > _SYMMETRY_TOLERANCE * top * scale:
                i, j = (int(v) for v in np.unravel_index(int(np.argmax(asym)), asym.shape))
                i, j = i + i0, j + j0
                raise InvalidArgumentError(
                    f"second_moment is not symmetric: [{i}, {j}] = {float(m[i, j])!r} but [{j}, {i}] = "
                    f"{float(m[j, i])!r} (E[x x^T] is; tolerance {_SYMMETRY_TOLERANCE:g} of max|H|)")
            sym = a * 0.5 + b * 0.5
            out[i0:i1, j0:j1] = sym
            out[j0:j1, i0:i1] = sym.T
    return out


def feedback_factor(h: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor ``U`` of ``(h + DAMPING * mean(diag h) * I)^-1`` (``U^T U`` = that inverse),
    for ``h`` as :func:`check_second_moment` returns it.

    Computed without forming the inverse: with ``J`` the order-reversing permutation, the Cholesky factor
    ``L`` of ``J h J`` gives ``h = R R^T`` with ``R = J L J`` upper triangular, so ``U = R^-1`` (upper, with a
    positive diagonal: the unique factor).  One Cholesky factorization (which also tells whether the damped
    matrix is positive definite) and one triangular inverse, half the work of GPTQ's Cholesky, inverse,
    Cholesky route, which gives the same matrix up to rounding."""
    n = h.shape[0]
    if n == 0:
        return np.zeros((0, 0))
    damp = DAMPING * float(np.mean(np.diagonal(h)))
    hd = h + damp * np.eye(n)
    try:
        low = np.linalg.cholesky(hd[::-1, ::-1])
    except np.linalg.LinAlgError:
        raise InvalidArgumentError(f"second_moment is not positive definite, even with {DAMPING:.0%} of its mean "
                                   f"diagonal ({damp:.6g}) added to the diagonal; a second moment E[x x^T] of "
                                   "inputs that are not all zero is") from None
    u = _upper_inverse(np.ascontiguousarray(low[::-1, ::-1]))
    if not np.isfinite(u).all():
        raise InvalidArgumentError("second_moment is too badly conditioned: the Cholesky factor of its inverse "
                                   "is not finite")
    return u


def _upper_inverse(r: np.ndarray) -> np.ndarray:
    """The inverse of the upper triangular ``r`` by halves, ``[[A, B], [0, C]]^-1 = [[A^-1, -A^-1 B C^-1],
    [0, C^-1]]``: matrix products do the work (n^3 / 3 multiply-adds), where numpy's general inverse would
    factor the matrix again (2 n^3)."""
    n = r.shape[0]
    if n <= 64:
        return np.triu(np.linalg.inv(r))
    k = n // 2
    a_inv, c_inv = _upper_inverse(r[:k, :k]), _upper_inverse(r[k:, k:])
    out = np.zeros_like(r)
    out[:k, :k] = a_inv
    out[k:, k:] = c_inv
    out[:k, k:] = -(a_inv @ r[:k, k:]) @ c_inv
    return out


def block_scales(payload, info: DTypeInfo, rows: int, cols: int) -> np.ndarray:
    """The scale of every value of a q*/k* payload, ``[rows, cols]`` float32, exactly as the decoder computes it
    (csrc/dequant.c): f16 with subnormals flushed to 0; k*: ``super * (float32(sub & 0x3f) / 32)``."""
    lay = quant_layout(info, (rows, cols))
    buf = np.asarray(payload, dtype=np.uint8).reshape(-1)
    reg = {r.name: buf[r.offset:r.offset + r.size] for r in lay.regions}

    def f16(b):
        h = b.view("<u2")
        return np.where(h & 0x7C00, h.view("<f2").astype(np.float32), np.float32(0))

    bpr = lay.blocks_per_row
    if "scales" in reg:
        s = f16(reg["scales"]).reshape(rows, bpr)
    else:
        sup = np.repeat(f16(reg["super_scales"]).reshape(rows, lay.supers_per_row), 8, axis=1)[:, :bpr]
        sub = (reg["sub_scales"] & 0x3F).astype(np.float32).reshape(rows, bpr) / np.float32(32)
        s = sup * sub
    return np.repeat(s, 32, axis=1)[:, :cols]


def feedback_codes(w: np.ndarray, scales: np.ndarray, u: np.ndarray, bits: int) -> np.ndarray:
    """The codes error feedback chooses for the float64 rows ``w`` ([n, cols]) with the per-value ``scales``
    (float32, as :func:`block_scales`) and the factor ``u`` (:func:`feedback_factor`): int8 [n, cols].

    Works on the transpose, one contiguous row per column of ``w``, so that a column's rounding and the
    rank-1 updates of the rest of its batch read and write contiguous memory; that loop is compiled
    (:func:`mcf._core._kernels.feedback_batch`), since in numpy its per-column calls cost more than their
    arithmetic on layers of a few hundred rows.  Each batch's update of the later columns is one matrix
    product."""
    n, cols = w.shape
    wt = np.ascontiguousarray(w.T, dtype=np.float64)          # [cols, n], updated in place
    st = np.ascontiguousarray(scales.T, dtype=np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(st != 0, np.float32(1) / st, np.float32(0)).astype(np.float32)
    codes = np.empty((cols, n), dtype=np.int8)
    err = np.empty((min(cols, BATCH_COLUMNS), n))
    for c0 in range(0, cols, BATCH_COLUMNS):
        c1 = min(cols, c0 + BATCH_COLUMNS)
        # inside the batch, column by column (compiled: the statement of each step is in its docstring)
        _kernels.feedback_batch(wt, st, inv, u, codes, err, c0, c1, bits)
        if c1 < cols:   # the rest of the row, once per batch
            wt[c1:] -= u[c0:c1, c1:].T @ err[:c1 - c0]
    return np.ascontiguousarray(codes.T)


def requantize_codes(payload: np.ndarray, read_rows, info: DTypeInfo, rows: int, cols: int, u: np.ndarray, *,
                     threads: int = 1) -> None:
    """Replace the codes of the q*/k* ``payload`` (``rows`` x ``cols``; its scales kept) by those error feedback
    chooses with the factor ``u`` for the values ``read_rows(r0, r1)`` returns (float32 rows [r0, r1), finite and
    clipped as the search saw them).  The payload is written in place, packed as the quantizers pack it.

    Rows go in chunks of at most ``_CHUNK_ROWS`` (fewer for wide tensors, so a chunk's float64 copy stays
    within ``_CHUNK_BYTES``), a size that does not depend on ``threads``: ``threads`` only runs chunks at the
    same time (the compiled loop and the matrix products release the GIL), and the bytes are the same."""
    lay = quant_layout(info, (rows, cols))
    step = max(1, min(_CHUNK_ROWS, _CHUNK_BYTES // max(1, 8 * cols)))
    scales = block_scales(payload, info, rows, cols)

    def run(r0):
        r1 = min(rows, r0 + step)
        w = np.array(read_rows(r0, r1), dtype=np.float64)
        codes = np.zeros((r1 - r0, lay.blocks_per_row * 32), dtype=np.int8)
        codes[:, :cols] = feedback_codes(w, scales[r0:r1], u, info.bits)
        _kernels.pack_codes(codes, info.code, payload, r0, rows=rows, cols=cols)   # disjoint rows per chunk

    starts = range(0, rows, step)
    if threads <= 1 or len(starts) <= 1:
        for r0 in starts:
            run(r0)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(starts))) as ex:
        list(ex.map(run, starts))
