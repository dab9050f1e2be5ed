"""Quantizing and dequantizing arrays to and from MCF's block formats.

The bit work is in C (csrc/quantize.c, csrc/dequant.c) behind :mod:`mcf._core._kernels`; this module owns the
policy: which tensors are quantized (rank-2 float tensors; everything else is copied), clipping ranges,
int8/int4 scale and zero point, row chunking so memory stays bounded.  Which tensors of a file are quantized, and
whole-file quantization, are in :mod:`mcf.conversion.quant_policy` (it uses this module, never the reverse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mcf._core import _fpconv
from mcf._core import _kernels as K
from mcf._core.args import integer, real, reals
from mcf._core.dtypes import DType, DTypeInfo, parse_dtype
from mcf._core.scaled import payload_rows
from mcf.errors import DTypeError, InvalidArgumentError
from mcf.container.decode import decode_payload
from mcf.container.error_feedback import check_second_moment, feedback_factor, requantize_codes
from mcf.container.layout import Domain, quant_layout

__all__ = ["quantize", "dequantize", "kernel_info", "QuantStats", "tensor_error_stats", "METHODS",
           "importance_weights"]

METHODS = ("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4")
_CHUNK_BYTES = 16 << 20  # float32 rows converted and quantized per step

kernel_info = K.kernel_info


def rows_f32(a: np.ndarray, r0: int, r1: int, src_dtype: DTypeInfo) -> np.ndarray:
    """Rows [r0, r1) as contiguous float32: a view of ``a`` when it already is, else a new array (the
    caller must not write into the result unless it checked which)."""
    part = a[r0:r1]
    if part.dtype.kind in "iu":  # raw bit patterns of src_dtype (e.g. bf16 as uint16), any byte order
        bits = np.ascontiguousarray(part, dtype=part.dtype.newbyteorder("<"))
        if src_dtype.code == DType.BF16:
            return _fpconv.bf16_to_f32(bits)
        part = bits.view(src_dtype.numpy)
    if src_dtype.code == DType.F32:
        return np.ascontiguousarray(part, dtype=np.float32)
    if src_dtype.code == DType.F16:
        return _fpconv.f16_to_f32(np.ascontiguousarray(part, dtype="<f2").view(np.uint16))
    if src_dtype.code == DType.BF16:  # ml_dtypes.bfloat16
        return _fpconv.bf16_to_f32(np.ascontiguousarray(part).view(np.uint16))
    if src_dtype.code == DType.F64:
        with np.errstate(over="ignore"):
            return np.ascontiguousarray(part, dtype=np.float32)
    raise DTypeError(f"cannot quantize a {src_dtype.name} tensor")


def _chunk_rows(cols: int) -> int:
    return max(1, _CHUNK_BYTES // max(1, 4 * cols))


def _float_dtype(a: np.ndarray, src_dtype) -> DTypeInfo:
    """The float dtype the values of ``a`` are in: its own (either byte order), or ``src_dtype`` when
    given, which must then be ``a``'s dtype or describe ``a`` as raw bit patterns of the same size."""
    own = None
    if a.dtype.name == "bfloat16":
        own = parse_dtype("bf16")
    elif a.dtype.kind == "f":
        own = parse_dtype(a.dtype.newbyteorder("<"))
    if src_dtype is None:
        if own is None:
            raise DTypeError(f"only float tensors can be quantized, got {a.dtype}")
        info = own
    else:
        info = parse_dtype(src_dtype)
        if own is not None and own.code != info.code:
            raise DTypeError(f"src_dtype={info.name} does not describe a {a.dtype} array")
        if own is None and not (a.dtype.kind in "iu" and a.dtype.itemsize == info.itemsize):
            raise DTypeError(f"src_dtype={info.name} needs {info.name} values or their raw bits "
                             f"({info.itemsize}-byte integers), got {a.dtype}")
    if info.family != "float":
        raise DTypeError(f"only float tensors can be quantized, got {info.name}")
    return info


def importance_weights(importance, cols: int) -> np.ndarray | None:
    """The per-column weights the search quantizer uses for an importance vector: one finite value >= 0
    per column, divided by its mean (so only the ratios matter: a mean of squares and a sum of squares give
    the same file).  None for ``None`` or an all-zero vector (no information: every column counts the same).

    The vector is first scaled by a power of two that brings its largest value into [0.5, 1): exact, so
    the weights are those of the plain division wherever that does not overflow, and the mean of values
    near the float64 limit (1e306 and up) cannot overflow to infinity and turn every weight into 0."""
    if importance is None:
        return None
    imp = reals(importance, "importance")
    if imp.ndim != 1 or imp.shape[0] != cols:
        raise InvalidArgumentError(f"importance has shape {imp.shape}; the tensor has {cols} columns, one value "
                                   "per column is needed")
    if not (np.isfinite(imp).all() and (imp >= 0).all()):
        bad = int(np.flatnonzero(~(np.isfinite(imp) & (imp >= 0)))[0])
        raise InvalidArgumentError(f"importance[{bad}] = {imp[bad]!r}; importance values must be finite and >= 0")
    top = float(imp.max()) if cols else 0.0
    if top == 0.0:
        return None
    imp = np.ldexp(imp, -math.frexp(top)[1])
    return np.ascontiguousarray(imp / imp.mean(), dtype=np.float32)


def _clip(value, what: str) -> float:
    """A clip as the float64 the caller meant; it must be finite and round to a finite float32, since
    the kernels clamp in float32 and QuantInfo stores it as one (1e39 was recorded as infinity)."""
    v = real(value, what)
    with np.errstate(over="ignore"):
        finite32 = math.isfinite(v) and math.isfinite(np.float32(v))
    if not finite32:
        raise InvalidArgumentError(f"{what} = {v!r}: clips must be finite and within the float32 range "
                                   f"(|x| <= {float(np.finfo(np.float32).max):.7g}); they are stored as float32")
    return v


def quantize(array, method, *, compat: bool = False, fast: bool = False, importance=None, second_moment=None,
             min_clip: float | None = None, max_clip: float | None = None, domain: int = Domain.WEIGHTS,
             src_dtype=None, impl=None, threads: int = 1):
    """Quantize a rank-2 float array (float32, float16, bfloat16, float64, either byte order;
    ``src_dtype="bf16"`` for raw uint16 bits) to ``method``.  Returns ``(payload, params)``: the payload
    bytes laid out as :func:`mcf.quant_layout` says, and the QuantInfo fields (``min_clip``,
    ``max_clip``, ``domain``).  ``array`` is only read, never modified (it may be a read-only mapping).

    q*/k* scales are searched for the smallest squared error of every block (k*: the super scale and
    the sub-scales together), evaluated with the scale the decoder reads, with codes over the whole
    two's-complement range and scales of either sign (the most negative code, -8 at 4 bits, goes to the
    side of the block where it helps); the result is never worse than the ``fast=True`` or the
    ``compat=True`` one, block by block, and any MCF decoder reads it (docs/quantization.md).
    ``importance`` (one value >= 0 per column, e.g. the mean squared input of that column from
    :mod:`mcf.conversion.imatrix`) weights each column's error in that search.  ``fast=True`` keeps the single-pass
    quantizer (much faster, ~1.5 dB worse at 4 bits, codes within +-qmax); ``compat=True`` reproduces the Go
    quantizer byte for byte (truncating f16 scales, codes within +-qmax).  Clips default to
    -max|x| and +max|x|, as the Go tool records them; explicit ones clamp the values before they are quantized, and
    must be real numbers that round to a finite float32 (QuantInfo stores them as float32).  NaN and infinity are
    refused, in the array and in the clips, and so is a block scale that would overflow f16, in every mode.
    ``threads`` splits the rows across threads (q*/k* without explicit clips, and the error feedback of
    ``second_moment``); the bytes do not depend on it.

    ``second_moment`` (the ``[cols, cols]`` matrix ``E[x x^T]`` of the layer's inputs ``x``, e.g. from
    :mod:`mcf.conversion.second_moment`) goes further than ``importance``: the scales are those of the search weighted
    by
    its diagonal, and the codes are chosen with error feedback through the whole matrix (GPTQ's method,
    :mod:`mcf.container.error_feedback`), which lowers the layer's output error ``trace(dW H dW^T)``; the file
    format is unchanged.  It must be finite, symmetric and positive definite once 1% of its mean diagonal is
    added to the diagonal; it replaces ``importance`` (give one of them) and, like it, needs the search.
    """
    if second_moment is not None:
        return _quantize_with_feedback(array, method, second_moment, compat=compat, fast=fast,
                                       importance=importance, min_clip=min_clip, max_clip=max_clip, domain=domain,
                                       src_dtype=src_dtype, impl=impl, threads=threads)
    a = np.asarray(array)
    info = parse_dtype(method)
    if not info.quantized:
        raise InvalidArgumentError(f"{info.name} is not a quantization method; expected one of {METHODS}")
    if a.ndim != 2:
        raise InvalidArgumentError(f"only rank-2 tensors are quantized, got shape {a.shape}")
    src = _float_dtype(a, src_dtype)
    rows, cols = a.shape
    if (min_clip is None) != (max_clip is None):
        raise InvalidArgumentError("give both min_clip and max_clip, or neither")
    if min_clip is not None:
        min_clip, max_clip = _clip(min_clip, "min_clip"), _clip(max_clip, "max_clip")
        if min_clip > max_clip:
            raise InvalidArgumentError(f"min_clip ({min_clip}) is above max_clip ({max_clip})")
    if compat and info.family == "raw":
        raise InvalidArgumentError("the Go tool has no int8/int4 quantizer to be compatible with")
    search = info.family != "raw" and not (fast or compat)
    weights = importance_weights(importance, cols) if importance is not None else None
    if importance is not None and not search:
        raise InvalidArgumentError("importance weights the error-minimizing search of the q*/k* methods; "
                                   "they do not apply with " + ("int8/int4" if info.family == "raw" else
                                                                "compat=True" if compat else "fast=True"))
    domain = integer(domain, "domain")
    if info.family != "raw" and domain != Domain.WEIGHTS:
        raise InvalidArgumentError(f"{info.name} supports only the weights domain")
    lay = quant_layout(info, (rows, cols), domain=domain)
    payload = np.zeros(lay.nbytes, dtype=np.uint8)
    step = _chunk_rows(cols)
    if info.family != "raw" and min_clip is None:
        # One pass over memory: each chunk (small enough to stay in L2) is checked and measured, then
        # quantized.  Clipping to -+max|x| changes nothing, so no clip is applied; the range is recorded.
        step = max(1, (1 << 20) // max(1, 4 * cols))
        if search:  # the search runs 16 rows at once, one per vector lane: whole groups keep every lane busy
            step = max(16, step - step % 16)

        def run(starts):
            m = 0.0
            for r in starts:
                x = rows_f32(a, r, min(rows, r + step), src)
                m = max(m, K.absmax(x, impl=impl))
                K.quantize_rows(x, info.code, payload, r, min_clip=-math.inf, max_clip=math.inf, compat=compat,
                                rows=rows, cols=cols, domain=domain, impl=impl, search=search, weights=weights)
            return m

        starts = list(range(0, rows, step))
        nthreads = max(1, min(integer(threads, "threads"), len(starts)))
        if nthreads == 1:
            amax = run(starts)
        else:  # chunks write disjoint rows of the payload; the kernels release the GIL
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(nthreads) as ex:
                amax = max(ex.map(run, [starts[k::nthreads] for k in range(nthreads)]))
        return payload, {"min_clip": float(-np.float32(amax)), "max_clip": float(np.float32(amax)),
                         "domain": domain}
    # pass 1: finiteness and range (needed up front by the clips and by int* scales)
    amax, lo, hi = 0.0, math.inf, -math.inf
    for r in range(0, rows, step):
        m, low, high = K.absmax_finite(rows_f32(a, r, min(rows, r + step), src))
        amax, lo, hi = max(amax, m), min(lo, low), max(hi, high)
    if rows * cols == 0:
        lo = hi = 0.0
    if min_clip is None:
        cmin, cmax = -np.float32(amax), np.float32(amax)
    else:
        cmin, cmax = np.float32(min_clip), np.float32(max_clip)
    scale = zero = 0.0
    if info.family == "raw":
        qmax = (1 << (info.bits - 1)) - 1
        if domain == Domain.WEIGHTS:
            m = max(abs(float(cmin)), abs(float(cmax)))
            scale = float(np.float32(m / qmax)) if m > 0 else 0.0
        else:
            if min_clip is not None:  # the range of the clipped values (data outside the clips included)
                lo_c = min(max(lo, float(cmin)), float(cmax))
                hi_c = min(max(hi, float(cmin)), float(cmax))
            else:
                lo_c, hi_c = lo, hi
            lo_c, hi_c = min(lo_c, 0.0), max(hi_c, 0.0)  # zero must be representable
            levels = (1 << info.bits) - 1
            scale = float(np.float32((hi_c - lo_c) / levels)) if hi_c > lo_c else 0.0
            qmin = -(1 << (info.bits - 1))
            zero = float(np.float32(qmin - lo_c / scale)) if scale else 0.0
        reg = {r.name: r for r in lay.regions}
        payload[reg["scale"].offset:reg["scale"].offset + 4] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)
        if "zero" in reg:
            payload[reg["zero"].offset:reg["zero"].offset + 4] = np.frombuffer(np.float32(zero).tobytes(), np.uint8)
        if not math.isfinite(scale) or not math.isfinite(zero):
            raise InvalidArgumentError("values too large for a float32 scale")
    for r in range(0, rows, step):
        # the kernels clamp each value to the clips as they read it: x (often a view of the caller's
        # array, or of a read-only mapping) is never written
        x = rows_f32(a, r, min(rows, r + step), src)
        lo_k, hi_k = (float(cmin), float(cmax)) if min_clip is not None else (-math.inf, math.inf)
        K.quantize_rows(x, info.code, payload, r, min_clip=lo_k, max_clip=hi_k, compat=compat,
                        rows=rows, cols=cols, scale=scale, zero=zero, domain=domain, impl=impl, search=search,
                        weights=weights)
    return payload, {"min_clip": float(cmin), "max_clip": float(cmax), "domain": domain}


def _quantize_with_feedback(array, method, second_moment, *, compat, fast, importance, min_clip, max_clip, domain,
                            src_dtype, impl, threads):
    """:func:`quantize` with ``second_moment``: everything checked before the search runs, then the search's
    scales and error feedback's codes."""
    info = parse_dtype(method)
    if not info.quantized:
        raise InvalidArgumentError(f"{info.name} is not a quantization method; expected one of {METHODS}")
    if importance is not None:
        raise InvalidArgumentError("give importance or second_moment, not both: the second moment's diagonal is "
                                   "the importance vector, and it is what weights the scales")
    if info.family == "raw" or compat or fast:
        raise InvalidArgumentError("second_moment chooses the codes of the error-minimizing search of the q*/k* "
                                   "methods; it does not apply with " + ("int8/int4" if info.family == "raw" else
                                                                         "compat=True" if compat else "fast=True"))
    a = np.asarray(array)
    if a.ndim != 2:
        raise InvalidArgumentError(f"only rank-2 tensors are quantized, got shape {a.shape}")
    src = _float_dtype(a, src_dtype)
    rows, cols = a.shape
    h = check_second_moment(second_moment, a.shape)
    u = feedback_factor(h)   # before the search: a matrix that is not positive definite fails fast
    payload, params = quantize(a, info, importance=np.diagonal(h), min_clip=min_clip, max_clip=max_clip,
                               domain=domain, src_dtype=src_dtype, impl=impl, threads=threads)
    lo, hi = (np.float32(params["min_clip"]), np.float32(params["max_clip"])) if min_clip is not None else (None, None)

    def read_rows(r0, r1):
        x = rows_f32(a, r0, r1, src)
        return x if lo is None else np.clip(x, lo, hi)

    requantize_codes(payload, read_rows, info, rows, cols, u, threads=integer(threads, "threads"))
    return payload, params


def dequantize(payload, method, shape, *, domain: int = Domain.WEIGHTS, dtype=np.float32, rows=None, out=None,
               impl: str | None = None, threads: int = 1) -> np.ndarray:
    """Decode a quantized payload to float32 / float16 / bfloat16, optionally only ``rows``
    (``(start, stop)`` or a slice), into ``out`` if given.  The result is ``[rows, cols]``; mxfp4 and nvfp4
    payloads may have any rank from 2, every dimension but the last counting as rows."""
    info = parse_dtype(method)
    if not info.quantized:
        raise InvalidArgumentError(f"{info.name} is not a quantized dtype")
    shape = tuple(integer(d, f"shape[{i}]") for i, d in enumerate(shape))
    payload_rows(info, shape)   # the rank rule of the dtype, before anything is read
    return decode_payload(payload, info, shape, domain=integer(domain, "domain"), dtype=dtype, rows=rows, out=out,
                          impl=impl, threads=threads)


@dataclass(frozen=True)
class QuantStats:
    name: str
    method: str
    shape: tuple
    rmse: float
    snr_db: float
    max_abs_err: float
    nbytes_in: int
    nbytes_out: int


def tensor_error_stats(original: np.ndarray, decoded: np.ndarray) -> tuple[float, float, float]:
    """(RMSE, SNR in dB, max |error|) of ``decoded`` against ``original``, accumulated in float64."""
    x = np.asarray(original, dtype=np.float64).reshape(-1)
    y = np.asarray(decoded, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return 0.0, math.inf, 0.0
    err = y - x
    mse = float(np.mean(err * err))
    sig = float(np.mean(x * x))
    snr = math.inf if mse == 0 else (10 * math.log10(sig / mse) if sig > 0 else -math.inf)
    return math.sqrt(mse), snr, float(np.max(np.abs(err)))
