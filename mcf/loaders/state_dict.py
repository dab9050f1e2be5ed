"""Loading weights as numpy arrays from either format: :func:`load_file` (the counterpart of
``safetensors.numpy.load_file``, for MCF files too) and :func:`load_state_dict` (decoded, cast,
optionally one tensor-parallel rank's share).

Both open an MCF file or a safetensors checkpoint (:func:`mcf.loaders.weights.open_weights` tells them
apart by the file's first bytes; a directory, a shard index or a ``.safetensors`` URL is safetensors), ask the format
for the
read plan of the tensors and pieces requested (:mod:`mcf.container.pieces`, :mod:`mcf.safetensors.load`)
and carry it out with the core's executor (:mod:`mcf.loading`), which reads every range straight into
the array that is returned.  The torch flavours, :func:`mcf.torch.load_file` and
:func:`mcf.torch.load_state_dict`, share everything here and differ only in where the bytes land.

The two functions differ in their defaults, which each keeps from what it mirrors: ``load_file`` returns
fresh arrays (as safetensors does); ``load_state_dict`` returns zero-copy read-only views of a mapped
file where nothing has to change (``copy=True`` for fresh arrays) and takes the tensor-parallel
arguments ``tp_rank``/``tp_size``/``tp_dim``.
"""

from __future__ import annotations

from typing import Callable

from mcf.loaders.weights import decode_threads, open_weights, plan_state_dict
from mcf.loading.arrays import load_arrays
from mcf.loading.casts import load_dtype
from mcf.loading.select import selection
from mcf.loading.slices import shard_range
from mcf.safetensors.load import dequantize_kind

__all__ = ["load_file", "load_state_dict", "shard_range"]


def load_file(path_or_file, names=None, *, slices=None, dtype=None, copy: bool = True, mmap=None, threads=None,
              chunk_bytes=None, dequantize=False) -> dict:
    """The tensors of an MCF file or a safetensors checkpoint as fresh numpy arrays (name -> array), like
    ``safetensors.numpy.load_file`` (for safetensors inputs, exactly its dict: see
    :func:`mcf.safetensors.load_file`).

    ``path_or_file``: an ``.mcf`` or ``.safetensors`` file (told apart by their first bytes), a checkpoint
    directory, a ``model.safetensors.index.json``, a URL of any of these, a buffer or file-like object,
    or an open :class:`mcf.Container` / :class:`mcf.safetensors.Checkpoint`.  MCF tensors come in the
    file's index order, safetensors tensors in the order of their data.
    ``names``: names or glob patterns; ``slices``: ``{name or pattern: mcf.Rows | mcf.Shard | None}``,
    reading only the bytes of each piece (:func:`mcf.safetensors.load_file` has the rules).
    ``dtype``: None keeps stored dtypes and decodes quantized MCF tensors to float32; a float dtype
    (float32, float16, bfloat16, float64) casts every F16/BF16/F32/F64 and quantized tensor to it; ``"raw"``
    returns quantized tensors as their payload bytes (uint8).  ``copy=False``: read-only views of the
    mapped file where a tensor is one unchanged stored range.  ``mmap``, ``threads`` (read engine
    workers, and decoding threads), ``chunk_bytes``: as :func:`mcf.safetensors.load_file`.
    ``dequantize`` (True or a float dtype): a safetensors checkpoint's block-scaled weights come back decoded
    in place of their parts, as :func:`mcf.safetensors.load_file` does.
    """
    kind = dequantize_kind(dequantize)
    with open_weights(path_or_file, mmap=mmap, copy=copy) as w:
        chosen, specs = selection(names, slices, w.use_weights(kind), w.where)
        pieces = w.pieces(chosen, specs, load_dtype(dtype), threads=decode_threads(threads), dequantize=kind)
        return load_arrays(pieces, copy=copy, threads=threads, chunk_bytes=chunk_bytes)


def load_state_dict(path_or_container, *, dtype=None, names=None, slices=None, tp_rank: int | None = None,
                    tp_size: int | None = None, tp_dim: int | Callable = 0, copy: bool = False, mmap=None,
                    threads=None, chunk_bytes=None) -> dict:
    """The tensors of an MCF file (or a safetensors checkpoint; any input :func:`load_file` takes) as
    numpy arrays, decoded and cast, for a training or inference loop.

    - Plain tensors come back in their stored dtype as **zero-copy, read-only views of the mapped file**
      where a tensor (or its share) is one contiguous stored range (they keep the mapping alive after the
      file is closed), unless ``copy=True`` asks for fresh writable arrays.  BF16 is
      ``ml_dtypes.bfloat16`` when that package is installed, else the raw ``uint16`` bit patterns.
    - Quantized tensors are dequantized straight into the returned array: float32 by default, or
      ``dtype``.
    - ``dtype`` (float32, float16, bfloat16, float64, as numpy dtypes, torch dtypes or strings) casts
      every float and quantized tensor; integer tensors keep their dtype.
    - ``names``: tensor names or glob patterns; ``slices``: a per-tensor plan of :class:`mcf.Rows` and
      :class:`mcf.Shard` (see :func:`mcf.safetensors.load_file`), or instead:
    - ``tp_rank``/``tp_size`` keep only one tensor-parallel rank's equal share of each tensor of two or
      more dimensions, along ``tp_dim``: 0 (rows; the layout of Megatron's column-parallel weights, whose
      rows are output features) or 1 (columns; row-parallel weights).  One-dimensional tensors (biases,
      norms) are returned whole.  A callable ``tp_dim(name, shape)`` returning 0, 1 or None (whole) sets
      the rule per tensor.  A dimension that does not divide evenly is an error.  Only each share's bytes
      are read; a quantized tensor decodes only its rows (and, for a column share on block boundaries,
      only its blocks).
    - ``threads`` splits quantized decoding across threads and sets the read engine's workers;
      ``chunk_bytes`` its chunk size; ``mmap`` how files are opened (None: the reader's default).
    """
    with open_weights(path_or_container, mmap=mmap, copy=copy) as w:
        pieces = plan_state_dict(w, names, slices, dtype, tp_rank, tp_size, tp_dim, threads)
        return load_arrays(pieces, copy=copy, threads=threads, chunk_bytes=chunk_bytes)
