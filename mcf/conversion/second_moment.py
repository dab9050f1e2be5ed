"""Second moments of the inputs of linear layers, E[x x^T], and their file: what error feedback quantizes with.

Why a second file next to the importance matrix (:mod:`mcf.conversion.imatrix`): an importance vector is the diagonal of
``H = E[x x^T]`` and can only weight each column's error, so it chooses block scales but not codes.  The whole
matrix lets :func:`mcf.quantize` choose the codes too (``second_moment=``, GPTQ's error feedback,
:mod:`mcf.container.error_feedback`), which on MiniLM lowers the (1 - cosine) of sentence embeddings about
twice as much as the importance vector (docs/quantization.md).  llama.cpp's imatrix format holds vectors
only, so the matrices get a file of their own.

The file is a plain safetensors file (any safetensors reader opens it; ``mcf`` reads it with its own
validating reader), one tensor per weight tensor:

- ``NAME``: F32 (or F64) ``[columns, columns]``, the mean over all calibration tokens of ``x x^T`` for the
  inputs ``x`` of the layer whose weight is ``NAME`` (accumulated in float64, made exactly symmetric).  Its
  diagonal is the importance vector of ``NAME``, so the same file serves as an importance matrix too
  (:func:`mcf.conversion.imatrix.read_imatrix` reads it);
- ``__metadata__``: ``format = "mcf.conversion.second_moment"`` and ``version = "1"`` (what makes it this kind of file),
  ``counts`` (a JSON object: NAME -> the number of tokens it was measured over), ``datasets`` (a JSON list of
  what the activations came from), ``chunk_count`` and ``chunk_size`` (decimal integers), as the imatrix
  records them.

Size: ``columns^2`` values per weight tensor, 74 MB for all-MiniLM-L6-v2 in float32; for a 7B llama-style
model several GB, since q/k/v and gate/up share inputs but each name gets its own matrix.  Matrices are read
one at a time, when a tensor needs its own (:class:`SecondMoments`).

:class:`SecondMomentCollector` accumulates them (``add(name, x)``), ``mcf imatrix --second-moment FILE``
(:func:`mcf.conversion.imatrix.collect_bert`) measures them on a BERT encoder.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import numpy as np

from mcf._core.args import file_path, integer, path_or_mapping, reals
from mcf._core.fs import open_regular, write_all, write_atomic
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import ArgumentTypeError, FormatError, InvalidArgumentError, UnsupportedVersionError
from mcf.safetensors.reader import SafetensorsFile

__all__ = ["FORMAT_TAG", "SecondMomentCollector", "SecondMoments", "write_second_moment", "read_second_moment",
           "is_second_moment_file", "as_second_moment"]

FORMAT_TAG = "mcf.conversion.second_moment"
_VERSION = "1"
_DTYPES = {"F32": np.float32, "F64": np.float64}


class RunningSums:
    """What a collector of layer-input statistics keeps (:class:`SecondMomentCollector` here,
    :class:`mcf.conversion.imatrix.ImportanceCollector`): per weight tensor, ``sums[name]`` over tokens and
    ``counts[name]``, the tokens summed."""

    def __init__(self):
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    @staticmethod
    def layer_inputs(name: str, x) -> np.ndarray:
        """``x`` checked as the ``[tokens, columns]`` real inputs of the layer whose weight is ``name``."""
        if not isinstance(name, str):
            raise ArgumentTypeError(f"the tensor name must be a str, got {name!r} ({type(name).__name__})")
        v = reals(x, f"the inputs of {name!r}")
        if v.ndim != 2:
            raise InvalidArgumentError(f"{name}: inputs must be [tokens, columns], got shape {v.shape}")
        return v

    def accumulate(self, name: str, value: np.ndarray, tokens: int) -> None:
        """Add ``value``, the statistic of ``tokens`` more tokens, to ``name``'s sum (a copy of it starts the
        sum); its shape must be the earlier inputs' (the same number of columns)."""
        if name in self.sums:
            if self.sums[name].shape != value.shape:
                raise InvalidArgumentError(f"{name}: {value.shape[0]} columns, earlier inputs had "
                                           f"{self.sums[name].shape[0]}")
            with np.errstate(over="ignore", invalid="ignore"):   # NaN or overflow: write() refuses the sums
                self.sums[name] += value
            self.counts[name] += tokens
        else:
            self.sums[name] = value.copy()
            self.counts[name] = tokens


def dataset_names(datasets) -> list[str]:
    """``datasets=`` of the writers: a sequence (or any iterable) of str or path-like, what the activations
    came from, as a list of str."""
    names = [] if isinstance(datasets, (str, bytes)) else iterable(datasets, "datasets")
    if isinstance(datasets, (str, bytes)) or not all(isinstance(d, (str, os.PathLike)) for d in names):
        raise ArgumentTypeError(f"datasets must be a sequence of str (what the activations came from), got "
                                f"{datasets!r}")
    return [os.fsdecode(d) for d in names]


def tensor_names(sums: Mapping) -> list[str]:
    """The names of ``sums``, each checked to be a str, sorted (the order both files store them in)."""
    for n in sums:
        if not isinstance(n, str):
            raise ArgumentTypeError(f"every tensor name must be a str, got {n!r} ({type(n).__name__})")
    return sorted(sums)


def iterable(obj, what: str) -> list:
    """The items of ``obj`` as a list; an object that cannot be iterated is an :class:`mcf.ArgumentTypeError`
    naming ``what``."""
    try:
        return list(obj)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be a sequence, got {type(obj).__name__}") from None


class SecondMomentCollector(RunningSums):
    """Running sums of ``x^T x`` (float64) per weight tensor: ``add(name, x)`` with the ``[tokens, columns]``
    input of that tensor's layer; :meth:`write` the file.  Layers that share their input (q, k and v) see
    the same values one after the other: the product of inputs equal to the previous call's is reused (a
    comparison costs ``tokens * columns``, the product ``tokens * columns^2``)."""

    def __init__(self):
        super().__init__()
        self._last = None   # (inputs as float64, their x^T x) of the previous call

    def add(self, name: str, x) -> None:
        v = np.array(self.layer_inputs(name, x), dtype=np.float64)
        if self._last is not None and self._last[0].shape == v.shape and np.array_equal(self._last[0], v):
            xx = self._last[1]
        else:
            with np.errstate(over="ignore", invalid="ignore"):   # NaN or overflow: write() refuses the sums
                xx = v.T @ v
            self._last = (v, xx)
        self.accumulate(name, xx, v.shape[0])

    def write(self, path, *, datasets=(), chunk_count: int = 0, chunk_size: int = 0, dtype=np.float32) -> None:
        write_second_moment(path, self.sums, self.counts, datasets=datasets, chunk_count=chunk_count,
                            chunk_size=chunk_size, dtype=dtype)


def write_second_moment(path, sums: Mapping, counts: Mapping, *, datasets=(), chunk_count: int = 0,
                        chunk_size: int = 0, dtype=np.float32) -> None:
    """Write the file: ``sums[name]`` (``[columns, columns]``, the sum over tokens of ``x x^T``) divided by
    ``counts[name]`` (tokens), as ``dtype`` (float32 or float64).  Everything is checked before anything is
    written, so a file this writes can always be read; it is written to a temporary name and renamed."""
    path = file_path(path, "path")
    datasets = dataset_names(datasets)
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise InvalidArgumentError(f"dtype must be float32 or float64, got {dt}")
    meta = {"format": FORMAT_TAG, "version": _VERSION,
            "datasets": json.dumps(datasets),
            "chunk_count": str(integer(chunk_count, "chunk_count", minimum=0)),
            "chunk_size": str(integer(chunk_size, "chunk_size", minimum=0))}
    tensors, cnt = [], {}
    for n in tensor_names(sums):
        if n == "__metadata__":
            raise InvalidArgumentError("a tensor named '__metadata__' cannot be stored in safetensors")
        if n not in counts:
            raise InvalidArgumentError(f"no token count for {n!r}")
        c = integer(counts[n], f"counts[{n!r}]", minimum=1)
        s = reals(sums[n], f"sums[{n!r}]")
        if s.ndim != 2 or s.shape[0] != s.shape[1]:
            raise InvalidArgumentError(f"sums[{n!r}] must be a square matrix (columns x columns), got shape {s.shape}")
        m = np.asarray(s, dtype=np.float64) / c
        with np.errstate(over="ignore"):
            m = ((m + m.T) * 0.5).astype(dt.newbyteorder("<"))
        if not np.isfinite(m).all():
            raise InvalidArgumentError(f"sums[{n!r}] / counts[{n!r}] is not finite in {dt}")
        tensors.append((n, m))
        cnt[n] = c
    meta["counts"] = json.dumps(cnt, separators=(",", ":"))
    header = {"__metadata__": meta}
    pos = 0
    st = "F32" if dt == np.float32 else "F64"
    for n, m in tensors:
        header[n] = {"dtype": st, "shape": list(m.shape), "data_offsets": [pos, pos + m.nbytes]}
        pos += m.nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)

    def write(fd):
        write_all(fd, struct.pack("<Q", len(raw)) + raw)
        for _n, m in tensors:
            write_all(fd, np.ascontiguousarray(m))

    write_atomic(path, write)


def is_second_moment_file(path) -> bool:
    """Whether ``path`` starts like a safetensors file whose metadata says ``format = "mcf.conversion.second_moment"``
    (the header is parsed and checked only by :class:`SecondMoments`)."""
    try:
        fd = open_regular(path)  # a FIFO or a device is not one (and must not block here)
    except (OSError, TypeError, ValueError):
        return False
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            return False
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= 100 << 20:
            return False
        start = os.pread(fd, min(n, 4096), 8)
    except OSError:
        return False
    finally:
        os.close(fd)
    return start[:1] == b"{" and b'"format":"' + FORMAT_TAG.encode() + b'"' in start.replace(b" ", b"")


class SecondMoments(Mapping, ClosedOnExit):
    """An open second-moment file: a read-only mapping name -> float64 ``[columns, columns]`` matrix, each
    read from the file (and checked: square, finite, a diagonal >= 0) when it is looked up.  ``counts``,
    ``datasets``, ``chunk_count`` and ``chunk_size`` are the metadata.  A file of another kind, or metadata
    that is not as the module describes, is an :class:`mcf.FormatError` naming the file and the field."""

    def __init__(self, path):
        self.path = file_path(path, "path")
        self._file = SafetensorsFile(self.path)
        try:
            self._check()
        except BaseException:
            self._file.close()
            raise

    def _check(self):
        meta, path = self._file.metadata, self.path
        if meta.get("format") != FORMAT_TAG:
            raise FormatError("not a second-moment file", path=path, field="__metadata__['format']",
                              expected=FORMAT_TAG, got=meta.get("format"))
        if meta.get("version") != _VERSION:
            raise UnsupportedVersionError("unsupported version", path=path, field="__metadata__['version']",
                                          expected=_VERSION, got=meta.get("version"))

        def js(key, kind):
            try:
                v = json.loads(meta.get(key, ""))
            except ValueError:
                v = None
            if not isinstance(v, kind):
                raise FormatError(f"must be a JSON {kind.__name__}", path=path, field=f"__metadata__[{key!r}]",
                                  got=meta.get(key))
            return v

        counts = js("counts", dict)
        self.datasets = js("datasets", list)
        for key in ("chunk_count", "chunk_size"):
            v = meta.get(key, "")
            if not (v.isascii() and v.isdigit()):
                raise FormatError("must be a decimal integer", path=path, field=f"__metadata__[{key!r}]", got=v)
            setattr(self, key, int(v))
        for n, t in self._file.tensors.items():
            if t.element.name not in _DTYPES or len(t.shape) != 2 or t.shape[0] != t.shape[1]:
                raise FormatError("a second moment is a square F32 or F64 matrix", path=path, field=n,
                                  got=f"{t.element.name} {list(t.shape)}")
            c = counts.get(n)
            if type(c) is not int or c < 1:
                raise FormatError("token count must be an integer >= 1", path=path,
                                  field=f"__metadata__['counts'][{n!r}]", got=c)
        extra = sorted(set(counts) - set(self._file.tensors))
        if extra:
            raise FormatError("a token count for a tensor the file does not hold", path=path,
                              field=f"__metadata__['counts'][{extra[0]!r}]")
        if not self._file.tensors:
            raise FormatError("no second moments in the file", path=path)
        self.counts = {n: counts[n] for n in sorted(self._file.tensors)}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._file.tensors[name]
        m = np.array(t.array(), dtype=np.float64)
        self._check_values(name, m)
        return m

    def diagonal(self, name: str) -> np.ndarray:
        """The diagonal of ``name``'s matrix (its importance vector), float64, read without the rest."""
        t = self._file.tensors[name]
        d = np.array(np.diagonal(t.array()), dtype=np.float64)
        self._check_values(name, d, diagonal=True)
        return d

    def _check_values(self, name, m, diagonal=False):
        bad = ~np.isfinite(m)
        if bad.any():
            i = tuple(int(v) for v in np.argwhere(bad)[0])
            raise FormatError("second moments must be finite", path=self.path, field=f"{name}{list(i)}",
                              got=float(m[i]))
        d = m if diagonal else np.diagonal(m)
        if (d < 0).any():
            i = int(np.flatnonzero(d < 0)[0])
            raise FormatError("the diagonal of a second moment (mean squared inputs) must be >= 0", path=self.path,
                              field=f"{name}[{i}, {i}]", got=float(d[i]))

    def __iter__(self):
        return iter(self.counts)

    def __len__(self):
        return len(self.counts)

    def close(self) -> None:
        self._file.close()


def read_second_moment(path) -> dict[str, np.ndarray]:
    """Every matrix of a second-moment file, name -> float64 ``[columns, columns]`` (all of them in memory:
    :class:`SecondMoments` reads one at a time)."""
    with SecondMoments(path) as sm:
        return {n: sm[n] for n in sm}


def as_second_moment(obj) -> Mapping:
    """``None`` -> {}; a path -> :class:`SecondMoments` (read lazily); a mapping (str name -> matrix) as it is."""
    return path_or_mapping(obj, "second_moment", "matrix", lambda p: SecondMoments(file_path(p, "second_moment")))
