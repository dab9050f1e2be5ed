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
  F8 as their raw bits (see :mod:`mcf.loading.dtypes`);
- ``dequantize=``: block-scaled weights (gpt-oss MXFP4, DeepSeek FP8, ModelOpt NVFP4:
  :mod:`mcf.safetensors.conventions`) come back decoded, one float tensor per weight in place of its parts;
  :func:`dequantize` decodes one.

The torch flavour is :func:`mcf.torch.load_file`; both formats (MCF and safetensors) load through
:func:`mcf.load_file`.
"""

from __future__ import annotations

import os

import numpy as np

from mcf._core.args import integer
from mcf.errors import DTypeError, TensorNotFoundError
from mcf.loading.arrays import load_arrays
from mcf.loading.casts import float_name
from mcf.loading.dtypes import ELEMENTS, FLOAT_ELEMENTS
from mcf.loading.plan import mmap_of_backend, plain_piece, source_options
from mcf.loading.scaled import scaled_piece
from mcf.loading.select import selection
from mcf.loading.slices import Rows, cut_of
from mcf.remote import redact
from mcf.safetensors.conventions import scaled_weights
from mcf.safetensors.reader import Checkpoint, SafetensorsFile, open_checkpoint

__all__ = ["load_file", "dequantize", "checkpoint_pieces", "open_for_load", "dequantized_order", "dequantize_kind"]


def open_for_load(filename, *, mmap=None, copy: bool = True):
    """``(checkpoint, owned)``: an open :class:`Checkpoint` or :class:`SafetensorsFile` as given (not
    owned), else :func:`open_checkpoint` of a path, directory, index, URL or buffer (owned)."""
    if isinstance(filename, Checkpoint):
        return filename, False
    if isinstance(filename, SafetensorsFile):
        return Checkpoint.of_files([filename]), False
    return open_checkpoint(filename, **source_options(mmap, copy)), True


def label(filename, ckpt: Checkpoint) -> str:
    """What errors call the checkpoint: the path or URL it was opened from (redacted), else its first file."""
    if isinstance(filename, (str, bytes, os.PathLike)):
        return redact(os.fsdecode(filename))
    return ckpt.index or (ckpt.files[0].source.name if ckpt.files else "<checkpoint>")


def dequantize_kind(dequantize) -> str | None:
    """``dequantize=`` as the float element block-scaled weights decode to (``"F32"`` for True), or None."""
    if dequantize is None or dequantize is False:
        return None
    return "F32" if dequantize is True else float_name(dequantize)


def dequantized_order(ckpt: Checkpoint, weights: dict) -> list:
    """The checkpoint's storage order with each block-scaled weight in place of its data tensor, its other
    tensors (scales) left out."""
    data = {sw.parts["data"].name: sw.name for sw in weights.values()}
    parts = {n for sw in weights.values() for n in sw.part_names}
    return [data.get(n, n) for n in ckpt.storage_order() if n in data or n not in parts]


def checkpoint_pieces(ckpt: Checkpoint, chosen: list, specs: dict, dtype, *, weights: dict | None = None,
                      dequantize: str | None = None, threads: int = 1) -> list:
    """The read plan of tensors ``chosen`` of ``ckpt``: the piece ``specs[name]`` of each (None: whole),
    float tensors (F16, BF16, F32, F64) cast to the float element ``dtype`` unless it is None/"raw".  Names of
    ``weights`` (:func:`mcf.safetensors.conventions.scaled_weights`) are block-scaled weights, decoded to the
    float element ``dequantize`` with ``threads`` threads."""
    pieces = []
    for n in chosen:
        sw = weights.get(n) if weights else None
        if sw is not None:
            data = sw.parts["data"]
            what = f"{data.file.source.name}: weight {n!r}"
            pieces.append(scaled_piece(n, sw.dtype, sw.shape, cut_of(specs.get(n), sw.shape, what),
                                       ELEMENTS[dequantize], sw.locate, threads=threads, what=what,
                                       on_error=lambda exc, sw=sw: _scale_error(exc, sw)))
            continue
        t = ckpt.tensors[n]
        what = f"{t.file.source.name}: tensor {n!r}"
        cut = cut_of(specs.get(n), t.shape, what)
        out = ELEMENTS[dtype] if dtype not in (None, "raw") and t.element.name in FLOAT_ELEMENTS else None
        pieces.append(plain_piece(n, t.file.source, t.offset, t.shape, t.element, cut, out=out, what=what))
    return pieces


def _scale_error(exc, sw):
    """A decoder's FormatError about the payload region ``scales[i]`` / ``scale`` as one naming the checkpoint's
    tensor that holds it (block ``i`` of ``weight_scale``, ``*_scales``...)."""
    region, _, index = (exc.field or "scales").partition("[")
    t = sw.parts.get(region, sw.parts["scales"])
    field = f"tensor {t.name!r}" + (f" block [{index}" if index else "")
    return type(exc)(f"{exc.reason} (weight {sw.name!r})", path=t.file.source.name, field=field,
                     expected=exc.expected, got=exc.got)


def load_file(filename, *, names=None, slices=None, copy: bool = True, mmap=None, threads=None,
              chunk_bytes=None, backend=None, dequantize=False) -> dict:
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
    ``dequantize``: False (tensors as stored), True (float32) or a float dtype (float16, bfloat16...): each
    block-scaled weight (gpt-oss MXFP4 ``*_blocks`` + ``*_scales``, DeepSeek FP8 ``weight`` +
    ``weight_scale_inv``, ModelOpt NVFP4 ``weight`` + ``weight_scale`` + ``weight_scale_2``:
    :mod:`mcf.safetensors.conventions`) is returned decoded under its weight's name (gpt-oss's without the
    ``_blocks`` suffix), in place of its parts; ``names``/``slices`` then name weights (a row range of a weight
    reads only its blocks).  Other tensors are as stored.
    """
    ckpt, owned = open_for_load(filename, mmap=mmap_of_backend(backend, mmap), copy=copy)
    try:
        kind = dequantize_kind(dequantize)
        weights = scaled_weights(ckpt.tensors) if kind else {}
        order = dequantized_order(ckpt, weights) if weights else ckpt.storage_order()
        chosen, specs = selection(names, slices, order, label(filename, ckpt))
        pieces = checkpoint_pieces(ckpt, chosen, specs, None, weights=weights, dequantize=kind,
                                   threads=1 if threads is None else integer(threads, "threads", minimum=1))
        return load_arrays(pieces, copy=copy, threads=threads, chunk_bytes=chunk_bytes)
    finally:
        if owned:
            ckpt.close()


def dequantize(filename, name: str, *, dtype=np.float32, rows=None, threads=None, mmap=None) -> np.ndarray:
    """The weight ``name`` of a safetensors checkpoint, decoded to float32 / float16 / bfloat16 (``dtype``).

    ``name`` is a block-scaled weight (:mod:`mcf.safetensors.conventions`: gpt-oss's
    ``model.layers.0.mlp.experts.gate_up_proj`` for ``..._blocks`` + ``..._scales``; DeepSeek's or ModelOpt's
    ``...weight``), decoded by the compiled kernels, or a plain F16 / BF16 / F32 / F64 tensor, cast.  ``rows``:
    ``(start, stop)`` of the first dimension (experts of an expert stack), reading only their bytes.
    ``filename``: what :func:`load_file` takes.  A NaN block scale (an E8M0 0xFF) is a :class:`mcf.FormatError`
    naming the scales tensor and the block.
    """
    kind = float_name(dtype)
    ckpt, owned = open_for_load(filename, mmap=mmap)
    try:
        weights = scaled_weights(ckpt.tensors)
        spec = None if rows is None else Rows(*rows)
        where = label(filename, ckpt)
        if name not in weights:
            t = ckpt.tensors.get(name)
            owner = next((sw.name for sw in weights.values() if name in sw.part_names), None)
            if owner is not None:
                raise TensorNotFoundError(f"{where}: {name!r} is a part of the block-scaled weight {owner!r}; "
                                          f"dequantize {owner!r}")
            if t is None:
                raise TensorNotFoundError(f"{where}: no tensor or block-scaled weight named {name!r}")
            if t.element.name not in FLOAT_ELEMENTS:
                raise DTypeError(f"{where}: tensor {name!r} is {t.element.name}, neither a float tensor nor part of a "
                                 "block-scaled weight (gpt-oss MXFP4, DeepSeek FP8, ModelOpt NVFP4)")
        pieces = checkpoint_pieces(ckpt, [name], {name: spec}, kind, weights=weights, dequantize=kind,
                                   threads=1 if threads is None else integer(threads, "threads", minimum=1))
        return load_arrays(pieces, threads=threads)[name]
    finally:
        if owned:
            ckpt.close()
