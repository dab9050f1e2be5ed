"""A drop-in for gguf-py's ``gguf.quants.dequantize``: same call, same results, compiled kernels.

Tools that read GGUF checkpoints in Python (transformers' GGUF loader among them) decode the blocks with
gguf-py's numpy dequantizer, ``gguf.quants.dequantize(data, qtype)``, at a few hundred MB/s.  This
function takes the same arguments and returns the same array (shape, dtype and every bit), so such a
tool can call it instead; docs/gguf.md shows how to hand it to transformers.

What "the same" covers, following gguf-py's rules:

- ``data`` is a numpy array of the tensor's bytes with rows on the last axis (what
  ``GGUFReader.tensors[i].data`` is); any dtype, read as its bytes.  The result is float32 with the
  same leading axes and ``bytes per row / type size * block size`` values per row.
- F32 data comes back as a float32 *view* of ``data``, as gguf-py returns it; every other type as a
  new array.
- Any memory layout: a transposed or strided array (rows or blocks picked with a step, a Fortran-ordered
  array) gives what gguf-py gives for it.  Where gguf-py's ``data.view(...)`` fails (the last axis is not
  contiguous and the item sizes differ: a transposed uint16 BF16 array, uint8 bytes picked with a step
  as F16 or F32), mcf decodes the values of a C-ordered copy instead of raising numpy's ``ValueError``.
- A row whose byte count is not a multiple of the type's block size in bytes raises a ``ValueError``
  (here :class:`mcf.InvalidArgumentError`, which is one) naming the count and the type.
- F64, Q8_K, Q1_0 and Q2_0, which gguf-py cannot decode (it raises ``NotImplementedError``), are
  decoded; the integer types and Q8_1 raise :class:`mcf.DTypeError` naming the type.

``qtype`` may be gguf-py's ``GGMLQuantizationType``, a ggml type code, a name (``"IQ4_XS"``) or a
:class:`mcf.gguf.GGMLType`; a code mcf does not know is a :class:`mcf.DTypeError` that lists the known ones.
"""

from __future__ import annotations

import numpy as np

from mcf.errors import ArgumentTypeError, DTypeError, InvalidArgumentError
from mcf.gguf.reader import SUPPORTED_TYPES, ggml_type

__all__ = ["dequantize"]


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """Decode ggml blocks to float32, exactly as ``gguf.quants.dequantize(data, qtype)`` does (see the
    module docstring for the rules), with mcf's compiled kernels (the best variant this CPU has, or
    ``MCF_FORCE_IMPL``)."""
    from mcf.gguf import _gguf

    if not isinstance(data, np.ndarray):
        raise ArgumentTypeError(f"data must be a numpy array of the tensor's bytes (as gguf.GGUFReader gives "
                                f"them), got {type(data).__name__}")
    t = ggml_type(qtype)
    if t.kind not in ("float", "quant"):
        raise DTypeError(f"ggml type {t.name} holds no values to dequantize (decodable: {', '.join(SUPPORTED_TYPES)})")
    if data.ndim == 0:
        raise InvalidArgumentError(f"data must have at least one axis (rows of {t.name} bytes), got a 0-d array")
    if data.dtype.hasobject:
        raise ArgumentTypeError(f"data must be an array of the tensor's bytes, got an array of dtype {data.dtype}")
    if t.name == "F32":  # gguf-py returns a view here: tools may rely on it costing nothing
        _check_row_bytes(data, t)
        return _view(data, np.float32)
    rows = _view(data, np.uint8)
    _check_row_bytes(rows, t)
    shape = (*rows.shape[:-1], rows.shape[-1] // t.size * t.block)
    out = np.empty(shape, dtype=np.float32)
    nblocks = rows.size // t.size
    if nblocks:
        _gguf.dequantize_blocks(np.ascontiguousarray(rows).reshape(-1), t.code, nblocks, out.reshape(-1))
    return out


def _view(data: np.ndarray, dtype) -> np.ndarray:
    """``data.view(dtype)``, as gguf-py takes it; an array numpy cannot view so (a transposed or strided
    array whose last axis is not contiguous, when the item sizes differ) is read as its values instead,
    from a C-ordered copy, where gguf-py raises numpy's ValueError."""
    try:
        return data.view(dtype)
    except ValueError:
        return np.ascontiguousarray(data).view(dtype)


def _check_row_bytes(data: np.ndarray, t) -> None:
    row_bytes = data.shape[-1] * data.dtype.itemsize
    if row_bytes % t.size:
        raise InvalidArgumentError(f"data: bytes per row ({row_bytes}) is not a multiple of the {t.name} block size "
                                   f"in bytes ({t.size}): the last axis must hold whole {t.name} blocks")
