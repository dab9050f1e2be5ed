"""``mcf.safetensors.load_file``: a safetensors checkpoint as a ``name -> numpy array`` dict, the dict
``safetensors.numpy.load_file`` returns, read through mcf's read engine.

Same keys in the same order (the order of the data in the file, shard after shard for a sharded
checkpoint), same dtypes and shapes, the same bytes; each array is the caller's own fresh memory.  What
safetensors does not do:

- a checkpoint directory, a ``model.safetensors.index.json`` (every shard, checked against the index)
  or a URL of any of these, as well as a file;
- ``names=`` (names or glob patterns) and ``slices=`` (:class:`mcf.Rows`, :class:`mcf.Shard`), which
  read only the bytes of the requested pieces;
- ``copy=False``: read-only views of the file's mapping, no read at all;
- F8 tensors as ``ml_dtypes`` float8 arrays (safetensors.numpy raises), and without ml_dtypes BF16 and
  F8 as their raw bits (see :mod:`mcf.loading.dtypes`).

The torch flavour is :func:`mcf.torch.load_file`; both formats (MCF and safetensors) load through
:func:`mcf.load_file`.
"""

from __future__ import annotations

import os

from mcf.loading.arrays import load_arrays
from mcf.loading.dtypes import ELEMENTS, FLOAT_ELEMENTS
from mcf.loading.plan import mmap_of_backend, plain_piece, source_options
from mcf.loading.select import selection
from mcf.loading.slices import cut_of
from mcf.safetensors.reader import Checkpoint, SafetensorsFile, open_checkpoint

__all__ = ["load_file", "checkpoint_pieces", "open_for_load"]


def open_for_load(filename, *, mmap=None, copy: bool = True):
    """``(checkpoint, owned)``: an open :class:`Checkpoint` or :class:`SafetensorsFile` as given (not
    owned), else :func:`open_checkpoint` of a path, directory, index, URL or buffer (owned)."""
    if isinstance(filename, Checkpoint):
        return filename, False
    if isinstance(filename, SafetensorsFile):
        return Checkpoint.of_files([filename]), False
    return open_checkpoint(filename, **source_options(mmap, copy)), True


def label(filename, ckpt: Checkpoint) -> str:
    """What errors call the checkpoint: the path or URL it was opened from, else its first file."""
    if isinstance(filename, (str, bytes, os.PathLike)):
        return os.fsdecode(filename)
    return ckpt.index or (ckpt.files[0].source.name if ckpt.files else "<checkpoint>")


def checkpoint_pieces(ckpt: Checkpoint, chosen: list, specs: dict, dtype) -> list:
    """The read plan of tensors ``chosen`` of ``ckpt``: the piece ``specs[name]`` of each (None: whole),
    float tensors (F16, BF16, F32, F64) cast to the float element ``dtype`` unless it is None/"raw"."""
    pieces = []
    for n in chosen:
        t = ckpt.tensors[n]
        what = f"{t.file.source.name}: tensor {n!r}"
        cut = cut_of(specs.get(n), t.shape, what)
        out = ELEMENTS[dtype] if dtype not in (None, "raw") and t.element.name in FLOAT_ELEMENTS else None
        pieces.append(plain_piece(n, t.file.source, t.offset, t.shape, t.element, cut, out=out, what=what))
    return pieces


def load_file(filename, *, names=None, slices=None, copy: bool = True, mmap=None, threads=None,
              chunk_bytes=None, backend=None) -> dict:
    """The tensors of a safetensors checkpoint as numpy arrays, as ``safetensors.numpy.load_file``
    returns them (same order, dtypes, shapes and bytes; fresh memory the caller owns).

    ``filename``: a ``.safetensors`` file, a checkpoint directory, a ``model.safetensors.index.json``,
    a URL of any of these, or an open :class:`SafetensorsFile` / :class:`Checkpoint`.
    ``names``: tensor names or glob patterns (``"layers.*.mlp.*"``) to load, in that order; an unknown
    name or a pattern matching nothing raises :class:`mcf.TensorNotFoundError`.  ``slices``: ``{name or
    pattern: mcf.Rows(start, stop) | mcf.Shard(rank, world, dim) | None}``, the piece of each tensor to
    read (the first matching entry wins; only those bytes are read).  ``copy=False``: read-only views of
    the file's mapping where a piece is one contiguous range of a mapped file (fresh arrays elsewhere).
    ``mmap``: map the files (True) or read them with pread (False); None leaves it to the reader.
    ``threads``/``chunk_bytes``: the read engine's workers and chunk size (None: chosen for the storage).
    ``backend``: safetensors' spelling of ``mmap`` (``"mmap"`` or ``"pread"``), accepted so that calls
    written for safetensors run unchanged.
    """
    ckpt, owned = open_for_load(filename, mmap=mmap_of_backend(backend, mmap), copy=copy)
    try:
        chosen, specs = selection(names, slices, ckpt.storage_order(), label(filename, ckpt))
        pieces = checkpoint_pieces(ckpt, chosen, specs, None)
        return load_arrays(pieces, copy=copy, threads=threads, chunk_bytes=chunk_bytes)
    finally:
        if owned:
            ckpt.close()
