"""``mcf.load_state_dict``: the tensors of an MCF file as a ``name -> numpy array`` dict, the way a training
or inference loop wants them (decoded, cast, optionally only one tensor-parallel rank's share).

The torch flavour, :func:`mcf.torch.load_state_dict`, shares the planning below (which rows or columns of
which tensor, which output dtype) and differs only in where the bytes land.

Why a function beside :meth:`mcf.Container.load`: ``load`` returns stored bytes (quantized tensors as
raw payloads), while a state dict must hold usable floats.  Here plain tensors are returned as zero-copy
views of the mapped file when nothing has to change, and everything else is decoded once, straight into
the array that is returned: a quantized tensor never passes through a float32 temporary on its way to a
float16 or bfloat16 result, and a tensor-parallel rank decodes only its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mcf._core.args import integer
from mcf.container.reader import Container, open as _open_container
from mcf._core.dtypes import DType
from mcf.errors import DTypeError, InvalidArgumentError

__all__ = ["load_state_dict", "shard_range"]

try:  # optional: a real bfloat16 numpy dtype
    import ml_dtypes as _ml_dtypes

    BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = None

_FLOAT_NAMES = {
    "float32": "f32", "f32": "f32", "fp32": "f32", "float": "f32",
    "float16": "f16", "f16": "f16", "fp16": "f16", "half": "f16",
    "bfloat16": "bf16", "bf16": "bf16",
    "float64": "f64", "f64": "f64", "double": "f64",
}


def _float_kind(dtype) -> str:
    """'f32', 'f16', 'bf16' or 'f64' for any spelling of a float dtype (numpy, ml_dtypes, torch, str)."""
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


def shard_range(n: int, tp_rank: int, tp_size: int, *, what: str = "dimension") -> tuple[int, int]:
    """``[start, stop)`` of rank ``tp_rank`` of ``tp_size`` equal shares of ``n``; ``n`` must divide evenly
    (Megatron's rule: an uneven split would give ranks different parameter shapes)."""
    if n % tp_size:
        raise InvalidArgumentError(f"{what} of size {n} does not split evenly into {tp_size} tensor-parallel ranks")
    k = n // tp_size
    return tp_rank * k, (tp_rank + 1) * k


@dataclass(frozen=True)
class Plan:
    """What to produce for one tensor: rows and columns of the stored tensor, and the output dtype."""

    name: str
    shape: tuple          # stored shape
    out_shape: tuple
    rows: tuple | None    # (r0, r1) along dim 0, or None for all
    cols: tuple | None    # (c0, c1) along dim 1, or None for all
    stored: DType
    quantized: bool
    kind: str | None      # output float kind ('f32', 'f16', 'bf16', 'f64') or None: keep the stored dtype


def _check_tp(tp_rank, tp_size):
    if tp_rank is None and tp_size is None:
        return None
    if tp_rank is None or tp_size is None:
        raise InvalidArgumentError("pass both tp_rank and tp_size, or neither")
    tp_rank, tp_size = integer(tp_rank, "tp_rank"), integer(tp_size, "tp_size")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tp_rank must be in 0..tp_size-1 and tp_size >= 1, got {tp_rank} of {tp_size}")
    return tp_rank, tp_size


def plan(c: Container, names, dtype, tp_rank, tp_size, tp_dim) -> list:
    """One :class:`Plan` per tensor; every argument is checked here, before any byte is read."""
    tp = _check_tp(tp_rank, tp_size)
    kind = None if dtype is None else _float_kind(dtype)
    if not callable(tp_dim) and tp_dim not in (0, 1):
        raise InvalidArgumentError(f"tp_dim must be 0, 1 or a callable(name, shape) -> 0 | 1 | None, got {tp_dim!r}")
    if names is None:
        names = list(c.keys())
    elif isinstance(names, str):
        raise InvalidArgumentError("names must be a list of tensor names, not one string")
    plans = []
    for name in names:
        t = c.info(name)   # TensorNotFoundError for an unknown name
        shape = tuple(t.shape)
        rows = cols = None
        if tp is not None:
            dim = tp_dim(name, shape) if callable(tp_dim) else (tp_dim if len(shape) >= 2 else None)
            if dim not in (0, 1, None):
                raise InvalidArgumentError(f"tp_dim({name!r}, {shape}) returned {dim!r}; expected 0, 1 or None")
            if dim is not None:
                if len(shape) <= dim:
                    raise InvalidArgumentError(f"tensor {name!r} of shape {shape} has no dimension {dim} to split")
                rng = shard_range(shape[dim], tp[0], tp[1], what=f"tensor {name!r} dimension {dim}")
                if dim == 0:
                    rows = rng
                else:
                    cols = rng
        out_shape = list(shape)
        if rows is not None:
            out_shape[0] = rows[1] - rows[0]
        if cols is not None:
            out_shape[1] = cols[1] - cols[0]
        if t.dtype.quantized:
            if len(shape) != 2:
                raise DTypeError(f"{c.path}: quantized tensor {name!r} has shape {shape}; expected 2 dimensions")
            k = kind or "f32"
        elif t.dtype.family == "float":
            k = kind
        else:
            k = None   # integer tensors keep their dtype (like Module.to(dtype), which casts floats only)
        plans.append(Plan(name, shape, tuple(out_shape), rows, cols, t.dtype.code, t.dtype.quantized, k))
    return plans


_STORED_KIND = {DType.F32: "f32", DType.F16: "f16", DType.BF16: "bf16", DType.F64: "f64"}


def needs_decode(p: Plan) -> bool:
    """True when the stored bytes are not already the output (quantized, or a cast)."""
    return p.quantized or (p.kind is not None and p.kind != _STORED_KIND.get(p.stored))


def decode_into(c: Container, p: Plan, out: np.ndarray, *, threads: int = 1) -> None:
    """Decode tensor ``p`` into ``out`` (C-contiguous, ``p.out_shape``, dtype of ``p.kind``; bfloat16 as
    uint16 bits or ml_dtypes.bfloat16): quantized payloads and float casts through the compiled kernels,
    written in place."""
    if p.kind == "f64":
        f32 = np.empty(p.out_shape, np.float32)
        decode_into(c, Plan(p.name, p.shape, p.out_shape, p.rows, p.cols, p.stored, p.quantized, "f32"), f32, threads=threads)
        out[...] = f32
        return
    if p.cols is None:
        if out.size:
            c.dequantize(p.name, rows=p.rows, out=out.reshape(-1), threads=threads)
        return
    # a column split: rows stay whole; decode a row block at a time into a bounded temporary
    c0, c1 = p.cols
    if p.quantized and not c.source.is_mapped:
        # each row block would fetch the whole payload again (Container.dequantize reads it per call)
        out[...] = c.dequantize(p.name, dtype=out.dtype, threads=threads)[:, c0:c1]
        return
    nrows, ncols = p.shape[0], p.shape[1]
    rest = int(np.prod(p.shape[2:], dtype=np.int64)) if len(p.shape) > 2 else 1
    step = max(1, (8 << 20) // max(1, ncols * rest * out.itemsize))
    for r in range(0, nrows, step):
        r1 = min(nrows, r + step)
        tmp = np.empty((r1 - r,) + p.shape[1:], dtype=out.dtype)
        c.dequantize(p.name, rows=(r, r1), out=tmp.reshape(-1), threads=threads)
        out[r:r1] = tmp[:, c0:c1]


def numpy_dtype(kind: str) -> np.dtype:
    if kind == "bf16":
        return BF16 if BF16 is not None else np.dtype(np.uint16)
    return np.dtype({"f32": np.float32, "f16": np.float16, "f64": np.float64}[kind])


def stored_view(c: Container, p: Plan, *, cow: bool = False) -> np.ndarray:
    """The tensor's stored values (zero-copy when mapped), restricted to the plan's rows/columns.  A row
    share reads only its rows' bytes (what matters when the source is a URL or read with pread).

    ``cow=True``: a writable array whose writes never reach the file (a private copy-on-write mapping,
    :meth:`mcf.io.Source.cow_view`), for callers that hand the memory to torch, which ignores numpy's
    read-only flag."""
    if p.rows is not None or cow:
        t = c.info(p.name)
        r0, r1 = p.rows if p.rows is not None else (0, p.shape[0] if p.shape else 1)
        row = t.nbytes // p.shape[0] if p.shape and p.shape[0] else t.nbytes
        dt = numpy_dtype("bf16") if t.dtype.code == DType.BF16 else t.dtype.numpy
        shape = (r1 - r0,) + tuple(p.shape[1:]) if p.shape else ()
        if cow:
            a = c.source.cow_view(t.offset + r0 * row, (r1 - r0) * row).view(dt).reshape(shape)
        else:
            a = c.source.array(t.offset + r0 * row, dt, shape)
    else:
        a = c.tensor(p.name)
    if p.cols is not None:
        a = a[:, p.cols[0]:p.cols[1]]
    return a


def open_input(path_or_container):
    """(container, owned): a Container as given, or one opened from a path, URL, buffer or file-like."""
    if isinstance(path_or_container, Container):
        return path_or_container, False
    return _open_container(path_or_container), True


def load_state_dict(path_or_container, *, dtype=None, names=None, tp_rank: int | None = None,
                    tp_size: int | None = None, tp_dim: int | Callable = 0, copy: bool = False,
                    threads: int = 1) -> dict:
    """Tensors of an MCF file (path, URL, file-like, buffer or open :class:`mcf.Container`) as numpy arrays.

    - Plain tensors come back in their stored dtype as **zero-copy, read-only views of the mapped file**
      (they keep the mapping alive after the container is closed), unless ``copy=True`` asks for fresh
      writable arrays (read with one compiled loop, like :meth:`Container.load`).  BF16 is
      ``ml_dtypes.bfloat16`` when that package is installed, else the raw ``uint16`` bit patterns.
    - Quantized tensors are dequantized straight into the returned array: float32 by default, or
      ``dtype``.
    - ``dtype`` (float32, float16, bfloat16, float64, as numpy dtypes, torch dtypes or strings) casts
      every float and quantized tensor; integer tensors keep their dtype.
    - ``tp_rank``/``tp_size`` keep only one tensor-parallel rank's equal share of each tensor of two or
      more dimensions, along ``tp_dim``: 0 (rows; the layout of Megatron's column-parallel weights, whose
      rows are output features) or 1 (columns; row-parallel weights).  One-dimensional tensors (biases,
      norms) are returned whole.  A callable ``tp_dim(name, shape)`` returning 0, 1 or None (whole) sets
      the rule per tensor.  A dimension that does not divide evenly is an error.  A row share of a
      quantized tensor decodes only those rows; a column share decodes a bounded block of rows at a time.
    - ``threads`` splits quantized decoding and ``copy=True`` reads across threads.
    """
    c, owned = open_input(path_or_container)
    try:
        plans = plan(c, names, dtype, tp_rank, tp_size, tp_dim)
        out = {}
        plain = [p for p in plans if not needs_decode(p)]
        if copy and plain:
            whole = [p.name for p in plain if p.rows is None and p.cols is None]
            if whole:
                out.update(c.load(whole, threads=threads))
        for p in plans:
            if p.name in out:
                continue
            if needs_decode(p):
                arr = np.empty(p.out_shape, numpy_dtype(p.kind))
                decode_into(c, p, arr, threads=threads)
                out[p.name] = arr
            else:
                a = stored_view(c, p)
                out[p.name] = np.array(a) if copy or not a.flags.c_contiguous else a
        return {p.name: out[p.name] for p in plans}
    finally:
        if owned:
            c.close()

