"""Float casts of loaded tensors (``dtype=``), written into the array that is returned.

One rounding from the stored value, to nearest even, whatever the pair: F16 and BF16 widen exactly to
float32 first (the compiled converters of :mod:`mcf._core._fpconv`), F64 narrows to F16 or BF16 in one
step (through float32 it would round twice).  The same rules as :meth:`mcf.Container.dequantize`, which
calls this for plain float tensors.
"""

from __future__ import annotations

import numpy as np

from mcf._core import _fpconv
from mcf.errors import DTypeError

__all__ = ["cast_into", "float_name", "load_dtype"]

_FLOAT_NAMES = {
    "float32": "F32", "f32": "F32", "fp32": "F32", "float": "F32",
    "float16": "F16", "f16": "F16", "fp16": "F16", "half": "F16",
    "bfloat16": "BF16", "bf16": "BF16",
    "float64": "F64", "f64": "F64", "double": "F64",
}


def float_name(dtype) -> str:
    """``"F32"``, ``"F16"``, ``"BF16"`` or ``"F64"`` for any spelling of a float dtype: numpy, ml_dtypes,
    torch (``torch.bfloat16``) or a string; anything else is :class:`mcf.DTypeError`."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or str(dtype)
    name = str(name).lower().removeprefix("torch.").removeprefix("<class 'numpy.").rstrip("'>")
    if name in _FLOAT_NAMES:
        return _FLOAT_NAMES[name]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt.name in _FLOAT_NAMES:
        return _FLOAT_NAMES[dt.name]
    raise DTypeError(f"dtype must be a float dtype (float32, float16, bfloat16 or float64), got {dtype!r}")


def load_dtype(dtype):
    """A loader's ``dtype=`` as None (keep what is stored; quantized MCF tensors decode to float32),
    ``"raw"`` (quantized MCF tensors as their payload bytes) or a float element name (``"F32"``...)."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype.strip().lower() == "raw":
        return "raw"
    return float_name(dtype)


_CHUNK = 1 << 20   # values converted at a time: the float32 temporary stays a few MiB, whatever the tensor


def cast_into(src: np.ndarray, src_name: str, out: np.ndarray) -> None:
    """Write the values of ``src`` (stored element ``src_name``: F32, F16, F64, or BF16 as uint16 bits or
    ml_dtypes.bfloat16) into ``out`` (C-contiguous, same size; float32, float16, float64, or bfloat16
    as uint16 bits or ml_dtypes.bfloat16)."""
    flat = src.reshape(-1)
    dst = out.reshape(-1)
    if flat.size != dst.size:
        raise AssertionError(f"cast_into: {flat.size} values into {dst.size}")
    for k in range(0, dst.size, _CHUNK):
        _cast_chunk(flat[k:k + _CHUNK], src_name, dst[k:k + _CHUNK])


def _cast_chunk(flat, src_name, dst):
    half = dst.dtype == np.float16
    bf16 = dst.dtype.name == "bfloat16" or dst.dtype == np.uint16
    if src_name == "F64":
        if half:
            dst.view(np.uint16)[...] = _fpconv.f64_to_f16(flat)
        elif bf16:
            dst.view(np.uint16)[...] = _fpconv.f64_to_bf16(flat)
        else:
            with np.errstate(over="ignore"):  # beyond the float32 range is infinity, as a cast should
                dst[...] = flat
        return
    if src_name in ("BF16", "F16"):
        widen = _fpconv.bf16_to_f32 if src_name == "BF16" else _fpconv.f16_to_f32
        bits = np.ascontiguousarray(flat).view(np.uint16)
        if dst.dtype == np.float32:
            widen(bits, out=dst)
            return
        f32 = widen(bits)
    elif src_name == "F32":
        f32 = np.ascontiguousarray(flat, dtype=np.float32)
    else:
        raise AssertionError(f"cast_into: {src_name} is not a float element")
    if half:
        _fpconv.f32_to_f16(f32, out=dst.view(np.uint16))
    elif bf16:
        _fpconv.f32_to_bf16(f32, out=dst.view(np.uint16))
    else:
        dst[...] = f32
