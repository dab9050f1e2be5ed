"""The rules every public function applies to counts, offsets, lengths, indices and real numbers.

Python and numpy convert a float to an integer silently in many places (``int(2.9) == 2``,
``np.asarray([2.9]).astype(np.int64)``), and a bool is an int to Python but a mask to numpy.  A reader
or writer that follows those conversions gives a wrong answer without an error: sequence 2 for
index 2.9, sequences 1, 0, 0, 0, 1 for a five-entry mask.  These helpers are the one place that
decides instead: integers are Python or numpy integers (never bools, never floats, even integral
ones), and an index array is what numpy accepts as one (an integer array, or a boolean mask with one
entry per item), anything else is refused with a message that names the argument.

Real-valued arguments (clip ranges, importance vectors) have the same problem the other way round:
``np.asarray(x, dtype=np.float64)`` turns a bool into 1.0, None into NaN, drops a complex number's
imaginary part with only a warning, and fails on a string or an object with a bare ``ValueError`` or
``TypeError`` that names nothing.  :func:`real` and :func:`reals` accept ints and floats (Python or
numpy, bfloat16 included) and refuse the rest by name; :func:`file_path` does the same for paths.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping

import numpy as np

from mcf.errors import ArgumentTypeError, InvalidArgumentError, OutOfBoundsError

__all__ = ["integer", "integers", "index_array", "slice_bounds", "row_range", "out_array", "byte_order_problem",
           "real", "reals", "file_path", "path_or_mapping"]

_INT64_MAX = (1 << 63) - 1


def integer(value, what: str, *, minimum: int | None = None) -> int:
    """``value`` as a Python int when it is an integer (``int`` or a numpy integer, not a bool), else
    :class:`mcf.InvalidArgumentError`; with ``minimum``, smaller values are refused too."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)
    if minimum is not None and v < minimum:
        raise InvalidArgumentError(f"{what} must be >= {minimum}, got {v}")
    return v


def slice_bounds(s: slice, n: int, what: str = "slice") -> tuple:
    """``(start, stop, step)`` of slice ``s`` over ``n`` items, as ``s.indices(n)`` computes them, once each
    bound is checked by :func:`integer` (or None): ``slice.indices`` itself takes ``True`` as 1 and
    raises a bare ``TypeError`` for a float and a bare ``ValueError`` for a zero step."""
    start, stop, step = s.start, s.stop, s.step
    if not (type(start) is int or start is None):
        start = integer(start, f"the start of the {what}")
    if not (type(stop) is int or stop is None):
        stop = integer(stop, f"the stop of the {what}")
    if not (type(step) is int or step is None):
        step = integer(step, f"the step of the {what}")
    if step == 0:
        raise InvalidArgumentError(f"the step of the {what} must not be zero")
    return slice(start, stop, step).indices(n)


def integers(values, what: str) -> np.ndarray:
    """A flat int64 array of ``values`` (a sequence or array of integers); float, bool, string and
    object values are refused, as are integers outside int64.  An empty sequence is an empty array."""
    a = values if isinstance(values, np.ndarray) else np.asarray(values)
    if a.size == 0:
        return np.empty(0, np.int64)
    if a.dtype.kind == "O":  # Python ints beyond int64, or mixed objects
        for v in a.reshape(-1):
            integer(v, f"every entry of {what}")
        raise OutOfBoundsError(f"{what} holds an integer outside int64")
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must be integers, got an array of {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and int(a.max()) > _INT64_MAX:
        raise OutOfBoundsError(f"{what} holds {int(a.max())}, outside int64")
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


def real(value, what: str) -> float:
    """``value`` as a Python float when it is a real number (``int``, ``float``, a numpy integer or
    floating; not a bool), else :class:`mcf.ArgumentTypeError`; an integer too large for a float is
    :class:`mcf.InvalidArgumentError`.  Infinities and NaN pass: the caller decides about those."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgumentError(f"{what} is an integer of {len(str(abs(int(value))))} digits, outside the "
                                   "float64 range") from None


def reals(values, what: str) -> np.ndarray:
    """``values`` (an array or a nested sequence of real numbers, any shape) as a float64 array; strings,
    mappings, bools, complex numbers, None and other objects are refused (:class:`mcf.ArgumentTypeError`),
    as are ragged nesting and integers beyond the float64 range (:class:`mcf.InvalidArgumentError`)."""
    try:
        a = values if isinstance(values, np.ndarray) else np.asarray(values)
    except (ValueError, TypeError) as exc:  # ragged nesting, or an object numpy cannot take apart
        raise InvalidArgumentError(f"{what} must be an array of real numbers ({exc})") from None
    if a.dtype.kind in "iuf" or (a.dtype.kind == "V" and np.can_cast(a.dtype, np.float64)):  # V: bfloat16
        return a.astype(np.float64)
    if a.ndim == 0:
        return np.array(real(a.item() if isinstance(values, np.ndarray) else values, what), dtype=np.float64)
    if a.dtype.kind != "O":
        raise ArgumentTypeError(f"{what} must be real numbers, got an array of {a.dtype}")
    flat = a.reshape(-1)
    return np.array([real(v, f"every entry of {what}") for v in flat], dtype=np.float64).reshape(a.shape)


def file_path(value, what: str):
    """``os.fspath(value)`` for a str, bytes or ``os.PathLike``; anything else (None, a number, a list)
    is :class:`mcf.ArgumentTypeError` naming ``what``, where ``os.fspath`` would raise a bare TypeError."""
    if isinstance(value, (str, bytes, os.PathLike)):
        return os.fspath(value)
    raise ArgumentTypeError(f"{what} must be a file path (str, bytes or os.PathLike), got {value!r} "
                            f"({type(value).__name__})")


def path_or_mapping(value, what: str, values: str, read) -> Mapping:
    """An argument that names tensors' data either way: ``None`` -> {}, a path -> ``read(path)``, a mapping
    whose keys are str (tensor names) as it is; anything else is an :class:`mcf.ArgumentTypeError` naming
    ``what`` and what the mapping's ``values`` are (``imatrix=``: a path or name -> importance)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise ArgumentTypeError(f"{what}: the names of a mapping must be str (tensor names), got {k!r} "
                                        f"({type(k).__name__})")
        return value
    if isinstance(value, (str, bytes, os.PathLike)):
        return read(value)
    raise ArgumentTypeError(f"{what} must be a file path or a mapping name -> {values}, got {type(value).__name__}")


def index_array(indices, n: int, what: str = "indices") -> np.ndarray:
    """numpy's meaning of a 1-D index array into ``n`` items, as int64 positions: integers as they are
    (negative ones still count from the end; the caller checks the range), a boolean mask of exactly
    ``n`` entries as the positions of its true entries.  Floats and other dtypes are refused, as
    numpy refuses them (``IndexError: arrays used as indices must be of integer (or boolean) type``)."""
    a = indices if isinstance(indices, np.ndarray) else np.asarray(indices)
    if a.ndim != 1:
        raise InvalidArgumentError(f"{what} must be one-dimensional, got shape {a.shape}")
    if a.dtype.kind == "b":
        if a.shape[0] != n:
            raise InvalidArgumentError(f"a boolean mask as {what} needs one entry per item ({n}), got {a.shape[0]}")
        return np.flatnonzero(a).astype(np.int64, copy=False)
    return integers(a, what)


def row_range(rows, total: int, exc=OutOfBoundsError) -> tuple:
    """``rows`` as ``(start, stop)`` within ``[0, total]``: None is every row, a slice follows Python's
    rules (step 1 only; out-of-range bounds are clipped), a pair must be two integers inside the range
    (else ``exc``)."""
    if rows is None:
        return 0, total
    if isinstance(rows, slice):
        start, stop, step = slice_bounds(rows, total, "row slice")
        if step != 1:
            raise InvalidArgumentError("row ranges must be contiguous (step 1)")
        return start, max(start, stop)
    try:
        r0, r1 = rows
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"rows must be (start, stop) or a slice, got {rows!r}") from None
    r0, r1 = integer(r0, "rows[0]"), integer(r1, "rows[1]")
    if not 0 <= r0 <= r1 <= total:
        raise exc(f"row range ({r0}, {r1}) outside 0..{total}")
    return r0, r1


def byte_order_problem(dt: np.dtype, what: str = "out") -> str | None:
    """The message for an output array in non-native byte order (the kernels write native values), or
    None: "must be float32, got >f4" would leave the reader wondering what is wrong with float32."""
    if dt.byteorder == ">":
        return (f"{what} is big-endian ({dt}); mcf writes native (little-endian) values: use "
                f"{dt.newbyteorder('=')} (and byteswap() afterwards if you need big-endian)")
    return None


def out_array(out, dtype, size: int, what: str = "out") -> np.ndarray:
    """``out`` checked as an output buffer, returned flat: a writeable, C-contiguous numpy array of
    exactly ``dtype`` (native byte order) with ``size`` elements, else :class:`mcf.InvalidArgumentError`
    saying which of these it is not."""
    want = np.dtype(dtype)
    if not isinstance(out, np.ndarray):
        raise InvalidArgumentError(f"{what} must be a numpy array of {want}, got {type(out).__name__}")
    msg = byte_order_problem(out.dtype, what)
    if msg:
        raise InvalidArgumentError(msg)
    if out.dtype != want:
        raise InvalidArgumentError(f"{what} must be a {want} array, got {out.dtype}")
    if out.size != size:
        raise InvalidArgumentError(f"{what} has {out.size} elements, {size} needed")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError(f"{what} must be C-contiguous and writeable")
    return out.reshape(-1)
