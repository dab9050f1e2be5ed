"""``mcf.torch.load_state_dict``: an MCF file as a ``name -> torch.Tensor`` dict, ready for
``module.load_state_dict``.  torch is optional: importing this module without it raises
:class:`mcf.MissingDependencyError` (an ImportError) that names the package and the extra.

Where the bytes go, and why:

- By default every tensor is the caller's own memory, as ``safetensors.torch.load_file`` returns them:
  in-place operations (``w.mul_(2)``) are fine and never reach the file.  Plain tensors are read by one
  compiled loop into one fresh arena (:meth:`mcf.Container.load`).
- ``copy=False`` opts into zero-copy tensors over the file: they lie in a private copy-on-write mapping
  (:meth:`mcf.io.Source.cow_view`), so nothing is read until a page is touched, and an in-place operation
  copies only the pages it writes, for this process alone; the file is never changed.  (torch ignores
  numpy's read-only flag, so a tensor over the shared read-only mapping that numpy arrays use would kill
  the process on its first write; no tensor returned here lies there.)
- Quantized tensors and float casts are decoded by the compiled kernels straight into the storage of the
  ``torch.Tensor`` that is returned (bfloat16 included: its storage is written as bf16 bits); a
  tensor-parallel rank decodes only its own rows.
- ``device`` other than ``"cpu"`` moves each tensor after it is decoded on the CPU.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mcf import state_dict as _sd
from mcf._core.optional import require
from mcf._core.dtypes import DType

_torch = require("torch", feature="mcf.torch", extra="torch")

__all__ = ["load_state_dict"]

_TORCH_OF_KIND = {"f32": _torch.float32, "f16": _torch.float16, "bf16": _torch.bfloat16, "f64": _torch.float64}
_TORCH_OF_STORED = {
    DType.F32: _torch.float32, DType.F16: _torch.float16, DType.BF16: _torch.bfloat16, DType.F64: _torch.float64,
    DType.I8: _torch.int8, DType.U8: _torch.uint8, DType.I16: _torch.int16, DType.I32: _torch.int32,
    DType.I64: _torch.int64,
}
# torch has uint16/32/64 only since 2.3, with few operations; the bits are kept as the same-size signed type
for _code, _attr, _fallback in ((DType.U16, "uint16", _torch.int16), (DType.U32, "uint32", _torch.int32),
                                (DType.U64, "uint64", _torch.int64)):
    _TORCH_OF_STORED[_code] = getattr(_torch, _attr, _fallback)


def _wrap(buf: np.ndarray, tdtype, shape) -> "_torch.Tensor":
    """A tensor over the bytes of ``buf`` (C-contiguous and writable), without copying."""
    if buf.nbytes == 0:
        return _torch.empty(shape, dtype=tdtype)
    if not buf.flags.writeable:  # torch would write through it anyway: never hand such memory out
        raise AssertionError("mcf.torch: a read-only buffer reached _wrap")
    raw = buf.reshape(-1).view(np.uint8)  # bytes view: ml_dtypes' bfloat16 has no buffer format
    return _torch.frombuffer(raw, dtype=tdtype).reshape(shape)


def _empty(shape, kind):
    """A fresh CPU tensor of ``kind`` and the numpy array over the same memory the kernels write to."""
    t = _torch.empty(shape, dtype=_TORCH_OF_KIND[kind])
    if kind == "bf16":
        arr = t.view(_torch.int16).numpy().view(np.uint16)  # the kernels write bf16 bits into uint16 outputs
    else:
        arr = t.numpy()
    return t, arr


def load_state_dict(path_or_container, *, device="cpu", dtype=None, names=None, tp_rank: int | None = None,
                    tp_size: int | None = None, tp_dim: int | Callable = 0, copy: bool = True,
                    threads: int = 1) -> dict:
    """Tensors of an MCF file (path, URL, file-like, buffer or open :class:`mcf.Container`) as torch tensors.

    ``dtype`` (a torch dtype such as ``torch.bfloat16``, or a string) casts every float and quantized
    tensor (quantized ones default to float32); integer tensors keep theirs.  ``tp_rank``/``tp_size``/
    ``tp_dim`` keep one tensor-parallel rank's share, with the rules of :func:`mcf.load_state_dict`.
    Every tensor is the caller's to modify.  ``copy=False`` makes unchanged plain tensors zero-copy views
    of a private copy-on-write mapping of the file (see the module docstring): in-place operations stay
    safe and private.  Unsigned 16/32/64-bit tensors use torch's uint16/32/64 where it has them (torch >=
    2.3), else the signed type of the same size holding the same bits.
    """
    dev = _torch.device(device)
    c, owned = _sd.open_input(path_or_container)
    try:
        plans = _sd.plan(c, names, dtype, tp_rank, tp_size, tp_dim)
        loaded = {}
        if copy:
            whole = [p.name for p in plans if not _sd.needs_decode(p) and p.rows is None and p.cols is None]
            if whole:
                loaded = c.load(whole, threads=threads)   # fresh, writable arena views
        out = {}
        for p in plans:
            if _sd.needs_decode(p):
                t, arr = _empty(p.out_shape, p.kind)
                _sd.decode_into(c, p, arr, threads=threads)
            else:
                tdt = _TORCH_OF_STORED[p.stored]
                a = loaded.get(p.name)
                if a is None:
                    a = _sd.stored_view(c, p, cow=not copy)
                    if copy or not a.flags.c_contiguous or not a.flags.writeable:
                        a = np.array(a, order="C")   # a row or column share, or a read-only one: copied
                t = _wrap(a, tdt, p.out_shape)
            if dev.type != "cpu":
                t = t.to(dev)
            out[p.name] = t
        return out
    finally:
        if owned:
            c.close()
