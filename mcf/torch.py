"""Loading weights as torch tensors: :func:`load_file` (the drop-in for ``safetensors.torch.load_file``,
for MCF files too) and :func:`load_state_dict` (decoded, cast, optionally one tensor-parallel rank's
share), ready for ``module.load_state_dict``.  torch is optional: importing this module without it raises
:class:`mcf.MissingDependencyError` (an ImportError) that names the package and the extra.

Where the bytes go, and why:

- By default every tensor is the caller's own memory, as ``safetensors.torch.load_file`` returns them:
  in-place operations (``w.mul_(2)``) are fine and never reach the file.  Each tensor is one fresh
  allocation (freeing it frees its memory), filled straight from storage by the read engine
  (:mod:`mcf.loading.plan`): one call for all the tensors of a file, no second copy.
- ``copy=False`` opts into zero-copy tensors over the file: they lie in a private copy-on-write mapping
  (:meth:`mcf.io.Source.cow_view`), so nothing is read until a page is touched, and an in-place operation
  copies only the pages it writes, for this process alone; the file is never changed.  (torch ignores
  numpy's read-only flag, so a tensor over the shared read-only mapping that numpy arrays use would kill
  the process on its first write; no tensor returned here lies there.)
- Quantized tensors and float casts are decoded by the compiled kernels straight into the storage of the
  ``torch.Tensor`` that is returned (bfloat16 included: its storage is written as bf16 bits); a
  tensor-parallel rank reads and decodes only its own share.
- ``device`` other than ``"cpu"`` (``"cuda"``, ``"cuda:1"``...) streams the tensors onto the device through a
  bounded ring of pinned host buffers (:mod:`mcf.loaders.device`): the next buffer is read (or decoded
  into) while the last one is copied to the device, and the host holds the ring plus 64 MiB whatever the
  model's size.  ``ring_buffers``/``ring_bytes`` size the ring (4 x 64 MiB); given with
  ``device="cpu"``, they send a CPU load through the same ring.

:func:`load_into` and :func:`load_model` (the drop-in for ``safetensors.torch.load_model``) fill tensors
and a module's parameters that the caller holds, in place, from the same read plans
(:mod:`mcf.loaders.into`, :mod:`mcf.loaders.torch_into`): GPU tensors through the same ring, and with
``group=`` each rank reading its share, as the loaders above.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from mcf.loaders import distributed as _distributed
from mcf.loaders import weights as _weights
from mcf.loaders.device import stream_to_device, torch_device
from mcf._core.memory import refused
from mcf._core.optional import require
from mcf.errors import DTypeError, InvalidArgumentError
from mcf.loading.casts import load_dtype
from mcf.loading.plan import ALIGN_FROM, execute, mmap_of_backend
from mcf.loading.select import selection
from mcf.safetensors.load import dequantize_kind

_torch = require("torch", feature="mcf.torch", extra="torch")

__all__ = ["load_file", "load_state_dict", "load_into", "load_model"]

# torch has uint16/32/64 only since 2.3, with few operations; before, the bits are kept as the same-size
# signed type
_FALLBACK = {"uint16": "int16", "uint32": "int32", "uint64": "int64"}
# the numpy dtype decoders write for each torch float result (bfloat16 as its uint16 bits)
_KERNEL_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def _torch_dtype(el, what: str):
    attr = el.torch
    t = getattr(_torch, attr, None) if attr else None
    if t is None and attr in _FALLBACK:
        t = getattr(_torch, _FALLBACK[attr])
    if t is None:
        raise DTypeError(f"{what}: {el.name} has no torch dtype in torch {_torch.__version__}")
    return t


def _torch_shape(el, shape: tuple, what: str) -> tuple:
    """torch's shape of a tensor of ``shape``: float4_e2m1fn_x2 holds two F4 values per element, so the
    last dimension halves (an odd one is refused, as safetensors refuses it)."""
    if el.name != "F4":
        return tuple(shape)
    if not shape or shape[-1] % 2:
        raise DTypeError(f"{what}: F4 loads as torch.float4_e2m1fn_x2, two values per element, which needs "
                         f"an even last dimension; got shape {tuple(shape)}")
    return tuple(shape[:-1]) + (shape[-1] // 2,)


def _load_tensors(pieces: list, *, copy: bool, device, threads, chunk_bytes, ring_buffers=None,
                  ring_bytes=None, group=None, weights=None) -> dict:
    """``name -> torch.Tensor`` for ``pieces``: fresh tensors (page-aligned from ALIGN_FROM bytes), or with
    ``copy=False`` views of the private copy-on-write mapping where a piece is one unchanged stored range
    of a mapped file.  On a device (or with a ring's settings): fresh tensors there, streamed through the
    ring (:func:`mcf.loaders.device.stream_to_device`).  ``group``: the
    :class:`mcf.loaders.distributed.GroupLoad` that shares the reads with the other ranks (``weights``: what
    the pieces come from); its result is moved to a device afterwards."""
    if group is not None and not copy:
        raise InvalidArgumentError("group= loads fresh tensors, read once and broadcast: it cannot return "
                                   "zero-copy views (copy=False) of each rank's own mapping")
    if group is not None and (ring_buffers is not None or ring_bytes is not None):
        raise InvalidArgumentError("group= broadcasts the ranks' reads through host memory, with no ring: "
                                   "ring_buffers/ring_bytes size the ring of a load without a group")
    dev = torch_device(device)
    kinds = {}
    for p in pieces:   # every dtype and shape checked before anything is allocated or read
        what = f"{p.source.name}: tensor {p.name!r}"
        kinds[p.name] = (_torch_dtype(p.element, what), _torch_shape(p.element, p.shape, what))
    if group is None and (dev.type != "cpu" or ring_buffers is not None or ring_bytes is not None):
        if not copy and dev.type == "cpu":
            raise InvalidArgumentError("copy=False returns views of the file, and ring_buffers/ring_bytes stream "
                                       "copies through a ring: pass one or the other")

        def fresh(p):
            tdt, tshape = kinds[p.name]
            return _torch.empty(tshape, dtype=tdt, device=dev)

        return stream_to_device(pieces, fresh, device=dev, ring_buffers=ring_buffers, ring_bytes=ring_bytes,
                                threads=threads, chunk_bytes=chunk_bytes)

    def alloc(p):
        tdt, tshape = kinds[p.name]
        nbytes = math.prod(tshape) * tdt.itemsize
        try:
            raw = _torch.empty(nbytes + 4096 if nbytes >= ALIGN_FROM else nbytes, dtype=_torch.uint8)
        except RuntimeError as exc:   # torch's CPU allocator refuses with a RuntimeError
            if "allocate" not in str(exc):
                raise
            raise refused(nbytes, p.source.name, p.name, str(exc).splitlines()[0]) from None
        if nbytes >= ALIGN_FROM:
            start = -raw.data_ptr() % 4096
            raw = raw[start:start + nbytes]
        t = raw.view(tdt).view(tshape)
        out = raw.numpy()
        kernel = _KERNEL_NUMPY.get(p.element.name)
        out = out.view(kernel).reshape(p.shape) if kernel is not None else out
        return t, out

    def view(p):
        if p.source.mode != "mmap":
            return None
        tdt, tshape = kinds[p.name]
        if p.view[1] == 0:
            return _torch.empty(tshape, dtype=tdt)
        cow = p.source.cow_view(p.view[0], p.view[1])
        if not cow.flags.writeable:  # torch would write through it anyway: never hand such memory out
            raise AssertionError("mcf.torch: a read-only buffer reached a tensor")
        return _torch.frombuffer(cow, dtype=_torch.uint8).view(tdt).view(tshape)

    if group is not None:
        out = group.load(pieces, alloc, weights=weights, threads=threads, chunk_bytes=chunk_bytes)
        return out if dev.type == "cpu" else {k: v.to(dev) for k, v in out.items()}
    return execute(pieces, alloc, view=None if copy else view, threads=threads, chunk_bytes=chunk_bytes)


def load_file(filename, device="cpu", *, names=None, slices=None, dtype=None, copy: bool = True, mmap=None,
              threads=None, chunk_bytes=None, backend=None, dequantize=False, ring_buffers=None,
              ring_bytes=None, group=None) -> dict:
    """The tensors of a safetensors checkpoint or an MCF file as torch tensors (name -> tensor), as
    ``safetensors.torch.load_file(filename, device)`` returns them: same order, dtypes (bfloat16, float8
    e4m3/e5m2, bool, every integer), shapes and bytes, each tensor the caller's own memory.

    ``filename``: a ``.safetensors`` or ``.mcf`` file (told apart by their first bytes), a checkpoint
    directory, a ``model.safetensors.index.json`` (every shard, checked against the index), a URL of any
    of these, or an open :class:`mcf.Container` / :class:`mcf.safetensors.Checkpoint`.  MCF tensors come
    in the file's index order, quantized ones dequantized to float32 (or ``dtype``; ``"raw"`` keeps
    their payload bytes as uint8).
    ``names``: names or glob patterns; ``slices``: ``{name or pattern: mcf.Rows | mcf.Shard | None}``:
    only the bytes of each piece are read (rules: :func:`mcf.safetensors.load_file`).  ``dtype``: a float
    dtype (``torch.bfloat16``, ``"float16"``...) every F16/BF16/F32/F64 and quantized tensor is cast to.
    ``copy=False``: unchanged tensors that are one contiguous range of a mapped file are zero-copy views
    of a private copy-on-write mapping (see the module docstring).  ``device``: where the tensors go (a
    torch device: ``"cuda"``, ``"cuda:1"``...), streamed there through a ring of ``ring_buffers`` pinned host
    buffers of ``ring_bytes`` each (None: 4 x 64 MiB), so that host memory stays at the ring plus 64 MiB
    (:mod:`mcf.loaders.device`); ring settings with ``device="cpu"`` send a CPU load through the same ring
    (``copy=True`` only).  ``mmap``, ``threads``, ``chunk_bytes``, ``backend``: as
    :func:`mcf.safetensors.load_file`.  ``dequantize`` (True for float32, or a float dtype such as
    ``torch.bfloat16``): a safetensors checkpoint's block-scaled weights (gpt-oss MXFP4, DeepSeek FP8, ModelOpt
    NVFP4) come back decoded under their weights' names, in place of their parts (rules:
    :func:`mcf.safetensors.load_file`).
    ``group`` (a ``torch.distributed`` process group: gloo, or NCCL with each rank's CUDA device set): every
    rank of the group calls this with the same checkpoint and each reads about 1/N of its bytes, which the
    ranks then broadcast to each other; a tensor the ranks' plans (``slices``) load differently is read by
    its rank alone.  A failure on any rank raises on every rank (rules: :mod:`mcf.loaders.distributed`).  The
    ranks broadcast through host memory: with ``device`` the whole result is moved there afterwards, and
    ``ring_buffers``/``ring_bytes`` are refused.
    """
    with _distributed.group_load(group) as gl:
        kind = dequantize_kind(dequantize)
        with _weights.open_weights(filename, mmap=mmap_of_backend(backend, mmap), copy=copy) as w:
            chosen, specs = selection(names, slices, w.use_weights(kind), w.where)
            pieces = w.pieces(chosen, specs, load_dtype(dtype), threads=_weights.decode_threads(threads),
                              dequantize=kind)
            return _load_tensors(pieces, copy=copy, device=device, threads=threads, chunk_bytes=chunk_bytes,
                                 ring_buffers=ring_buffers, ring_bytes=ring_bytes, group=gl, weights=w)


def load_state_dict(path_or_container, *, device="cpu", dtype=None, names=None, slices=None,
                    tp_rank: int | None = None, tp_size: int | None = None, tp_dim: int | Callable = 0,
                    copy: bool = True, mmap=None, threads=None, chunk_bytes=None, ring_buffers=None,
                    ring_bytes=None, group=None) -> dict:
    """Tensors of an MCF file (or a safetensors checkpoint: any input :func:`load_file` takes) as torch
    tensors.

    ``dtype`` (a torch dtype such as ``torch.bfloat16``, or a string) casts every float and quantized
    tensor (quantized ones default to float32); integer tensors keep theirs.  ``names``/``slices`` or
    ``tp_rank``/``tp_size``/``tp_dim`` keep one tensor-parallel rank's share, with the rules of
    :func:`mcf.load_state_dict`, reading only its bytes.  Every tensor is the caller's to modify.
    ``copy=False`` makes unchanged plain tensors zero-copy views of a private copy-on-write mapping of the
    file (see the module docstring): in-place operations stay safe and private.  Unsigned 16/32/64-bit
    tensors use torch's uint16/32/64 where it has them (torch >= 2.3), else the signed type of the same
    size holding the same bits.  ``device``, ``ring_buffers``, ``ring_bytes``: as :func:`load_file` (a
    device load streams through the ring; quantized tensors are decoded into its buffers).
    ``group``: a ``torch.distributed`` process group sharing the reads, as in :func:`load_file`; with
    ``tp_rank``/``tp_size`` (or ``slices``) each rank reads its own shares, and the tensors every rank loads
    whole (norms, biases) are read once and broadcast.
    """
    with _distributed.group_load(group) as gl, _weights.open_weights(path_or_container, mmap=mmap, copy=copy) as w:
        pieces = _weights.plan_state_dict(w, names, slices, dtype, tp_rank, tp_size, tp_dim, threads)
        return _load_tensors(pieces, copy=copy, device=device, threads=threads, chunk_bytes=chunk_bytes,
                             ring_buffers=ring_buffers, ring_bytes=ring_bytes, group=gl, weights=w)


def load_into(tensors, filename, *, names=None, slices=None, mapping=None, strict: bool = True, dequantize=False,
              mmap=None, backend=None, threads=None, chunk_bytes=None, ring_buffers=None, ring_bytes=None,
              group=None) -> tuple:
    """Fill the torch tensors ``tensors`` (a mapping destination name -> tensor) in place from a checkpoint;
    returns ``(missing, unexpected)`` as :func:`load_model` does.

    Every tensor keeps its memory (``data_ptr``): one that is C-contiguous on the CPU is filled by the read
    engine straight from storage (cast or decoded into it when the checkpoint holds another float type or a
    quantized tensor); a contiguous tensor on a GPU (any device but the CPU) through the ring of pinned host
    buffers, as :func:`load_file` streams onto a device (``ring_buffers``/``ring_bytes`` size it; given, they
    send contiguous CPU tensors through the same ring); a strided view through bounded CPU staging and
    ``copy_``.  ``filename``: what :func:`load_file` reads, or a GGUF file.  ``names``, ``slices``,
    ``mapping``, ``strict``, ``dequantize`` and the rest: as :func:`mcf.load_into` (the numpy flavour), whose
    rules apply unchanged.  A tensor on the meta device is refused (it has no memory): :func:`load_model`
    gives a module's meta tensors memory.
    ``group`` (a ``torch.distributed`` process group): every rank calls this with the same checkpoint and
    fills its tensors with all of it, each rank reading about 1/N of the bytes, as :func:`load_file`; the
    broadcasts land in the C-contiguous CPU tensors themselves, and any other tensor (a GPU one, a strided
    view) is staged whole in host memory and copied in (no ring: ``ring_buffers``/``ring_bytes`` are
    refused with a group).
    """
    return _torch_into().load_into(tensors, filename, names=names, slices=slices, mapping=mapping, strict=strict,
                                   dequantize=dequantize, mmap=mmap, backend=backend, threads=threads,
                                   chunk_bytes=chunk_bytes, ring_buffers=ring_buffers, ring_bytes=ring_bytes,
                                   group=group)


def load_model(model, filename, strict: bool = True, device=None, *, names=None, slices=None, mapping=None,
               dequantize=False, mmap=None, backend=None, threads=None, chunk_bytes=None, ring_buffers=None,
               ring_bytes=None, group=None) -> tuple:
    """Load a checkpoint into ``model``'s parameters and buffers, in place: the drop-in for
    ``safetensors.torch.load_model(model, filename, strict, device)``, with its return value ``(missing,
    unexpected)``: the model's names nothing filled, the checkpoint's names the model did not take.

    - Every parameter and buffer with memory keeps it (``data_ptr`` unchanged; a refit of a live model
      allocates nothing): read straight into it when the checkpoint holds its dtype, cast or decoded into it
      otherwise (a float32 model from a bfloat16 checkpoint holds what ``load_state_dict`` would copy in).
    - Those on the meta device (``with torch.device("meta"):`` or accelerate's ``init_empty_weights()``) get
      memory once, on ``device`` (default: the CPU), then are filled; non-persistent buffers there (a
      transformers model's rotary ``inv_freq``) are computed as ``from_pretrained`` computes them, or refused.
    - Tied weights (``lm_head.weight`` and ``embed_tokens.weight``: one tensor under two names) are filled
      once and stay one tensor; the checkpoint needs one of the names (``safetensors.torch.save_model`` keeps
      one), and another name of the same tensor in it is unexpected, as safetensors counts it.
    - ``strict=True`` refuses any missing or unexpected tensor with one :class:`mcf.LoadMismatchError` (a
      RuntimeError, as safetensors raises) naming them all, and leaves the model untouched; a shape that
      differs is refused whatever ``strict``.  Every name, shape and dtype is checked before a byte is read.
    - ``filename``: anything :func:`load_file` reads (a safetensors file, a sharded checkpoint's directory or
      index, an MCF file, a URL of any of these), or a GGUF file, whose names a transformers model takes from
      transformers' own GGUF table (and whose llama Q/K rows it reorders as transformers does) unless
      ``mapping`` is given.
    - ``names``/``slices``/``mapping`` (a dict checkpoint name -> model name, or a callable; None leaves a
      tensor out) and ``dequantize`` (decode block-scaled FP8/MXFP4/NVFP4 safetensors weights into the
      parameter's dtype): as :func:`mcf.load_into`.  ``backend``/``mmap``, ``threads``, ``chunk_bytes``: as
      :func:`load_file`.
    - A model on a GPU (or meta tensors given memory there, ``device="cuda"``) is filled through the ring of
      pinned host buffers, as :func:`load_file` streams onto a device; ``ring_buffers``/``ring_bytes``: as
      :func:`load_into`.
    - ``group`` (a ``torch.distributed`` process group): every rank fills its model with the whole checkpoint
      while reading about 1/N of its bytes, as :func:`load_into` with a group (a refit keeps every
      ``data_ptr``).
    """
    return _torch_into().load_model(model, filename, strict=strict, device=device, names=names, slices=slices,
                                    mapping=mapping, dequantize=dequantize, mmap=mmap, backend=backend, threads=threads,
                                    chunk_bytes=chunk_bytes, ring_buffers=ring_buffers, ring_bytes=ring_bytes,
                                    group=group)


def _torch_into():
    from mcf.loaders import torch_into

    return torch_into
