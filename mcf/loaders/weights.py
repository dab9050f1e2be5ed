"""Any checkpoint to the pieces to read: the one entry every loader starts from.

:func:`open_weights` tells an MCF file from a safetensors checkpoint by its first bytes (a directory, a
shard index or a ``.safetensors`` URL is safetensors), opens it with its format's reader and answers,
as :class:`Weights`, with the tensors in the order a load returns them and the read plan of any pieces of
them (:mod:`mcf.container.pieces`, :mod:`mcf.safetensors.load`).  The core's executor
(:mod:`mcf.loading.plan`) carries a plan out; :mod:`mcf.loaders.state_dict` (numpy) and :mod:`mcf.torch`
differ only in where the bytes land.
"""

from __future__ import annotations

import errno
import os

from mcf.io import Source, open_source
from mcf._core.args import integer
from mcf._core.lifetime import ClosedOnExit
from mcf.container.layout import MAGIC
from mcf.container.pieces import tensor_piece
from mcf.container.reader import Container
from mcf.errors import InvalidArgumentError
from mcf.loading.casts import load_dtype
from mcf.loading.plan import source_options
from mcf.loading.select import select_names, selection
from mcf.loading.slices import Shard
from mcf.remote import is_url, redact
from mcf.safetensors.conventions import scaled_weights
from mcf.safetensors.load import checkpoint_pieces, dequantized_order, label
from mcf.safetensors.reader import Checkpoint, SafetensorsFile, name_kind, open_checkpoint, url_name

__all__ = ["Weights", "open_weights", "plan_state_dict", "tp_specs", "decode_threads"]



class Weights(ClosedOnExit):
    """An open MCF container or safetensors checkpoint, as the loaders see it: the tensors in the order
    a load returns them, their shapes, and the read plan of pieces of them."""

    def __init__(self, obj, owned: bool, where: str):
        self.obj = obj
        self.owned = owned
        self.where = where
        self.is_mcf = isinstance(obj, Container)
        self.order = list(obj.keys()) if self.is_mcf else obj.storage_order()
        self.weights = {}

    def shape(self, name: str) -> tuple:
        return tuple(self.obj.info(name).shape if self.is_mcf else self.obj.tensors[name].shape)

    def pieces(self, chosen: list, specs: dict, dtype, *, threads: int = 1, dequantize: str | None = None) -> list:
        """The read plan of ``chosen`` (``specs``: name -> Rows | Shard | None; ``dtype``: as
        :func:`mcf.loading.casts.load_dtype` returns it; ``dequantize``: the float element a safetensors
        checkpoint's block-scaled weights decode to, None to load their tensors as stored)."""
        if self.is_mcf:
            return [tensor_piece(self.obj, n, specs.get(n), dtype, threads=threads) for n in chosen]
        return checkpoint_pieces(self.obj, chosen, specs, dtype, weights=self.weights if dequantize else None,
                                 dequantize=dequantize, threads=threads)

    def use_weights(self, dequantize: str | None) -> list:
        """Load a safetensors checkpoint's block-scaled weights decoded (``dequantize``: their float element)
        rather than their parts: the names a load returns, in order.  MCF files decode theirs anyway."""
        if dequantize and not self.is_mcf:
            self.weights = scaled_weights(self.obj.tensors)
            return dequantized_order(self.obj, self.weights)
        return self.order

    def close(self) -> None:
        if self.owned:
            self.obj.close()


def _sniffed(src: Source, owned: bool, where: str) -> Weights:
    """An MCF container or a one-file safetensors checkpoint over ``src``, by its first bytes."""
    try:
        is_mcf = src.size >= len(MAGIC) and src.read(0, len(MAGIC)) == MAGIC
        obj = Container(src, owns_source=owned) if is_mcf else Checkpoint.of_files([SafetensorsFile(src)])
    except BaseException:
        if owned:
            src.close()
        raise
    return Weights(obj, owned, where)


def open_weights(obj, *, mmap=None, copy: bool = True) -> Weights:
    """An MCF file or a safetensors checkpoint, opened for loading: an open :class:`mcf.Container`,
    :class:`mcf.safetensors.Checkpoint` or ``SafetensorsFile`` as given; a directory, a
    ``model.safetensors.index.json`` or a ``.safetensors`` URL as a safetensors checkpoint
    (:func:`mcf.safetensors.reader.locate_checkpoint` says which files; a URL by its path, query aside);
    any other path, URL, buffer, file-like object or :class:`mcf.io.Source` by the magic of its first
    bytes, a URL that is not there being a directory."""
    opts = source_options(mmap, copy)
    if isinstance(obj, Container):
        return Weights(obj, False, obj.path)
    if isinstance(obj, (Checkpoint, SafetensorsFile)):
        ck = obj if isinstance(obj, Checkpoint) else Checkpoint.of_files([obj])
        return Weights(ck, False, label(None, ck))
    if isinstance(obj, Source):
        return _sniffed(obj, False, obj.name)
    if is_url(obj):
        url = os.fsdecode(obj)
        where = redact(url)
        if name_kind(url) is not None:   # a .safetensors file, an index or a directory, by the URL's path
            return Weights(open_checkpoint(url, **opts), True, where)
        try:
            src = open_source(url)
        except OSError as exc:
            # a "directory" URL: nothing there (S3), a refusal (nginx forbids listing a directory; S3
            # answers 403 for a missing key to whoever may not list the bucket), a directory (fsspec)
            gone = isinstance(exc, (FileNotFoundError, PermissionError)) or exc.errno == errno.EISDIR
            if not gone or url_name(url).endswith(".mcf"):
                raise
            return Weights(open_checkpoint(url, **opts), True, where)
        return _sniffed(src, True, where)
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        if os.path.isdir(path) or (path.endswith(".json") and os.path.isfile(path)):
            return Weights(open_checkpoint(path, **opts), True, path)
        return _sniffed(open_source(path, **opts), True, path)
    return _sniffed(open_source(obj), True, "<buffer>" if not hasattr(obj, "seek") else repr(obj))


def tp_specs(w: Weights, chosen: list, tp_rank, tp_size, tp_dim) -> dict:
    """``name -> Shard | None`` of the tensor-parallel arguments: rank ``tp_rank`` of ``tp_size`` along
    ``tp_dim`` (0 or 1, for tensors of two or more dimensions; or ``tp_dim(name, shape) -> 0 | 1 | None``)."""
    if tp_rank is None and tp_size is None:
        return {}
    if tp_rank is None or tp_size is None:
        raise InvalidArgumentError("pass both tp_rank and tp_size, or neither")
    tp_rank, tp_size = integer(tp_rank, "tp_rank"), integer(tp_size, "tp_size")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tp_rank must be in 0..tp_size-1 and tp_size >= 1, got {tp_rank} of {tp_size}")
    if not callable(tp_dim) and (isinstance(tp_dim, bool) or tp_dim not in (0, 1)):
        raise InvalidArgumentError(f"tp_dim must be 0, 1 or a callable(name, shape) -> 0 | 1 | None, got {tp_dim!r}")
    specs = {}
    for name in chosen:
        shape = w.shape(name)
        dim = tp_dim(name, shape) if callable(tp_dim) else (tp_dim if len(shape) >= 2 else None)
        if dim is not None and (isinstance(dim, bool) or dim not in (0, 1)):
            raise InvalidArgumentError(f"tp_dim({name!r}, {shape}) returned {dim!r}; expected 0, 1 or None")
        specs[name] = None if dim is None else Shard(tp_rank, tp_size, dim)
    return specs


def plan_state_dict(w: Weights, names, slices, dtype, tp_rank, tp_size, tp_dim, threads) -> list:
    """The read plan of a ``load_state_dict`` call (every argument checked here, before any byte is read)."""
    kind = load_dtype(dtype)
    if slices is not None and (tp_rank is not None or tp_size is not None):
        raise InvalidArgumentError("pass slices= or tp_rank/tp_size, not both")
    if slices is not None:
        chosen, specs = selection(names, slices, w.order, w.where)
    else:
        chosen = select_names(names, w.order, w.where)
        specs = tp_specs(w, chosen, tp_rank, tp_size, tp_dim)
    return w.pieces(chosen, specs, kind, threads=decode_threads(threads))


def decode_threads(threads) -> int:
    """Threads of the decoding kernels: ``threads`` when given, else one."""
    return 1 if threads is None else integer(threads, "threads", minimum=1)
