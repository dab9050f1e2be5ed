"""The element types a loaded tensor can have, named as safetensors names them (``F32``, ``BF16``,
``F8_E4M3``, ``BOOL``...): the one table the loaders of both formats, numpy and torch, agree on.

safetensors files name their dtypes this way, and every plain MCF dtype has one of these names (the
table says which), so a plan of tensors to load speaks one vocabulary whatever the file.  Each entry
says how many bits a value takes, the numpy dtype and the torch dtype that hold it, and the MCF dtype
of the same bits, if any (what ``mcf pack`` can store: every one but BOOL, C64 and the F6 types; FP8,
E8M0 and F4 as mcf's extension dtypes).

numpy has no bfloat16 or float8 of its own: they come from ``ml_dtypes`` when it is installed (what
``safetensors.numpy`` uses too).  Without it, mcf returns their raw bits as unsigned integers of the
same size (``uint16`` for BF16, ``uint8`` for the F8 types), the rule mcf's readers have always
followed for bfloat16; ``safetensors.numpy`` raises there.  F4 (two values packed in a byte) and the
F6 types have no numpy dtype at all, and F6 none in torch either: loading them is refused with
:class:`mcf.DTypeError`, as safetensors refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mcf._core.dtypes import DType
from mcf.errors import DTypeError

__all__ = ["Element", "ELEMENTS", "element", "element_of_mcf", "numpy_dtype", "BF16_NUMPY", "FLOAT_ELEMENTS"]

try:  # optional: numpy dtypes for bfloat16 and the float8 types (safetensors.numpy uses it too)
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None


@dataclass(frozen=True)
class Element:
    """One element type: ``bits`` per value, the numpy dtype (``ml_dtypes`` attribute when prefixed
    ``ml:``; None: numpy cannot hold it), the ``torch`` attribute (None: torch cannot hold it), the MCF
    dtype of the same bits (None: MCF has none) and the ``fallback`` numpy dtype of the raw bits when
    ``ml_dtypes`` is missing."""

    name: str
    bits: int
    numpy: str | None
    torch: str | None
    mcf: DType | None = None
    fallback: str | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per value; 0 for the sub-byte types (F4, F6), which load whole and cannot be sliced."""
        return self.bits // 8 if self.bits % 8 == 0 else 0


ELEMENTS = {e.name: e for e in (
    Element("BOOL", 8, "bool", "bool"),
    Element("U8", 8, "uint8", "uint8", DType.U8),
    Element("I8", 8, "int8", "int8", DType.I8),
    Element("I16", 16, "int16", "int16", DType.I16),
    Element("U16", 16, "uint16", "uint16", DType.U16),
    Element("I32", 32, "int32", "int32", DType.I32),
    Element("U32", 32, "uint32", "uint32", DType.U32),
    Element("I64", 64, "int64", "int64", DType.I64),
    Element("U64", 64, "uint64", "uint64", DType.U64),
    Element("F16", 16, "float16", "float16", DType.F16),
    Element("BF16", 16, "ml:bfloat16", "bfloat16", DType.BF16, "uint16"),
    Element("F32", 32, "float32", "float32", DType.F32),
    Element("F64", 64, "float64", "float64", DType.F64),
    Element("C64", 64, "complex64", "complex64"),
    Element("F8_E4M3", 8, "ml:float8_e4m3fn", "float8_e4m3fn", DType.F8_E4M3, "uint8"),
    Element("F8_E5M2", 8, "ml:float8_e5m2", "float8_e5m2", DType.F8_E5M2, "uint8"),
    Element("F8_E4M3FNUZ", 8, "ml:float8_e4m3fnuz", "float8_e4m3fnuz", DType.F8_E4M3FNUZ, "uint8"),
    Element("F8_E5M2FNUZ", 8, "ml:float8_e5m2fnuz", "float8_e5m2fnuz", DType.F8_E5M2FNUZ, "uint8"),
    Element("F8_E8M0", 8, "ml:float8_e8m0fnu", "float8_e8m0fnu", DType.F8_E8M0, "uint8"),
    Element("F4", 4, None, "float4_e2m1fn_x2", DType.F4),
    Element("F6_E2M3", 6, None, None),
    Element("F6_E3M2", 6, None, None),
)}

#: The float types ``dtype=`` casts to and from (F8 and F4 are scaled formats whose values mean little
#: without their scale tensors: they are kept as stored).
FLOAT_ELEMENTS = frozenset({"F16", "BF16", "F32", "F64"})

_BY_MCF = {e.mcf: e for e in ELEMENTS.values() if e.mcf is not None}

#: numpy's bfloat16 (``ml_dtypes.bfloat16``), or None without ml_dtypes.
BF16_NUMPY = np.dtype(_ml_dtypes.bfloat16) if _ml_dtypes is not None else None


def element(name: str) -> Element | None:
    """The element type a safetensors header calls ``name``, or None for a name safetensors does not
    know (the reader turns that into a :class:`mcf.FormatError` naming the file and tensor)."""
    return ELEMENTS.get(name) if isinstance(name, str) else None


def element_of_mcf(code) -> Element:
    """The element type of a plain MCF dtype (quantized dtypes have none: they decode to floats)."""
    return _BY_MCF[DType(code)]


def numpy_dtype(el: Element, what: str) -> np.dtype:
    """The numpy dtype that holds ``el``: ml_dtypes' type, or without ml_dtypes the raw-bits fallback.
    ``what`` names the tensor (and file) in the :class:`mcf.DTypeError` for F4 and F6."""
    spec = el.numpy
    if spec is None:
        why = ("two 4-bit values packed in each byte" if el.name == "F4" else "6-bit values")
        raise DTypeError(f"{what}: {el.name} ({why}) has no numpy dtype; safetensors.numpy refuses it too"
                         + ("; mcf.torch loads it as torch.float4_e2m1fn_x2" if el.torch else ""))
    if spec.startswith("ml:"):
        if _ml_dtypes is None:
            return np.dtype(el.fallback)
        return np.dtype(getattr(_ml_dtypes, spec[3:]))
    return np.dtype(spec)
