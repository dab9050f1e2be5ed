"""Weights into memory the caller already holds: :func:`load_into` (numpy arrays), and the machinery of
:func:`mcf.torch.load_into` and :func:`mcf.torch.load_model` (torch tensors, a module's parameters).

A load into existing memory allocates no result: every destination keeps its memory (``data_ptr``) and
the checkpoint's bytes land in it.  It runs in three steps, and nothing is read (or written) until the
first two have passed for every tensor:

1. **Names** (:func:`plan_into`): the checkpoint's tensors that ``names=`` picks, renamed by ``mapping=``
   (a dict or a callable; None drops a tensor), are matched with the destinations.  A destination no
   tensor fills is *missing*, a tensor no destination takes is *unexpected*; ``strict=True`` refuses either,
   naming every one in one :class:`mcf.LoadMismatchError`.  Two checkpoint names for one destination, and
   two destinations whose memory overlaps without being the same, are refused.  Destinations that are
   the same memory (tied weights: ``lm_head.weight`` and ``embed_tokens.weight`` of one model) are one
   group, filled once from the first of its names the checkpoint holds (``safetensors.torch.load_model``'s
   rule: the group's other names are not missing, and the checkpoint's other names for it are unexpected).
2. **Shapes and dtypes**: each piece (a whole tensor, or its ``slices=`` part) must have its destination's
   shape (else :class:`mcf.LoadMismatchError`, every one named) and either its element type or a float one
   it casts to: F16/BF16/F32/F64 cast to each other, quantized MCF and GGUF tensors and block-scaled weights
   (``dequantize=``) decode into any of them.  Anything else is :class:`mcf.DTypeError`.
3. **Fill** (:func:`fill`): one read plan (:mod:`mcf.loading.plan`) whose results are the destinations'
   own memory: a tensor stored as its destination holds it is read by the read engine straight into
   that memory; casts and quantized tensors decode through the executor's bounded staging into it.  A
   destination that is not C-contiguous CPU memory (a strided view, a GPU tensor) is filled through
   staging buffers of at most :data:`mcf.loading.plan.STAGING_BYTES` (or one tensor, if larger) that its
   ``store`` copies in.  With a group (:mod:`mcf.loaders.distributed`) the ranks share the reads and
   broadcast into the same memory; a destination without memory is then staged whole.

A destination is a :class:`Target`: the numpy face builds them here (:func:`numpy_target`), the torch
face in :mod:`mcf.loaders.torch_into`.  :func:`fill` takes the pieces and a ``name -> Target`` mapping and
nothing else, so how a target is reached can change without touching how it is planned: the torch face
sends tensors on a GPU through the pinned ring of :mod:`mcf.loaders.device` rather than through
:func:`fill`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mcf._core.args import byte_order_problem
from mcf._core.memory import allocating
from mcf.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, LoadMismatchError, TensorNotFoundError
from mcf.loaders.weights import decode_threads, open_weights
from mcf.loading.dtypes import ELEMENTS, FLOAT_ELEMENTS, Element, numpy_dtype
from mcf.loading.plan import STAGING_BYTES, aligned_bytes, execute, mmap_of_backend
from mcf.loading.select import selection
from mcf.remote import is_url
from mcf.safetensors.load import dequantize_kind
from mcf.safetensors.reader import url_name

__all__ = ["Target", "IntoPlan", "plan_into", "fill", "numpy_target", "open_for_into", "load_into", "mismatch_error"]

# the numpy dtype the decoders write for each float element (bfloat16 as its uint16 bits)
_KERNEL_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


@dataclass(eq=False)
class Target:
    """One destination of a load.

    ``element`` and ``shape``: what it holds, in the plan's terms (a piece must have this shape).
    ``memory``: a flat uint8 numpy array over its bytes when it is C-contiguous, writable CPU memory the
    read engine can fill in place; None otherwise, and then ``store(staging)`` copies a filled staging
    buffer (flat uint8, the destination's bytes in C order) into it.  ``pending``: it has no memory yet (a
    tensor on torch's meta device): the face gives it some once the plan has passed its checks.

    ``span`` ``(place, start, stop)``: the bytes it covers (None: no memory, or none to fill), and
    ``layout`` what tells two views of the same bytes apart; destinations of one span and layout are the
    same memory (tied), overlapping ones that are not are refused.  ``ident``: for a destination without
    memory, an identity shared by the names of one tensor.  ``bits_of``: stored element types whose bits
    it holds as they are (numpy without ml_dtypes: BF16 in uint16).
    """

    name: str
    element: Element
    shape: tuple
    memory: np.ndarray | None = None
    store: Callable | None = None
    span: tuple | None = None
    layout: tuple | None = None
    ident: int | None = None
    bits_of: frozenset = frozenset()
    pending: bool = False

    @property
    def nbytes(self) -> int:
        return -(-math.prod(self.shape) * self.element.bits // 8)


@dataclass
class IntoPlan:
    """A checked load: ``pieces`` (checkpoint order, one per destination group filled), ``targets``
    (piece name -> :class:`Target`), ``missing`` (destination names nothing fills, in the destinations'
    order) and ``unexpected`` (checkpoint names no destination takes, in the checkpoint's order)."""

    pieces: list
    targets: dict
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)


def mismatch_error(where: str, into: str, *, missing=(), unexpected=(), sizes=()) -> LoadMismatchError:
    """One error naming every missing and unexpected tensor and every shape that differs."""
    lines = [f"{where}: the checkpoint does not match {into}:"]
    if missing:
        lines.append(f"    missing ({len(missing)}, in the destinations, not in the checkpoint): "
                     + ", ".join(repr(n) for n in missing))
    if unexpected:
        lines.append(f"    unexpected ({len(unexpected)}, in the checkpoint, in no destination): "
                     + ", ".join(repr(n) for n in unexpected))
    for ck, dest, got, want in sizes:
        lines.append(f"    shape mismatch for {dest!r}: the checkpoint's {ck!r} is {tuple(got)}, the destination "
                     f"is {tuple(want)}")
    return LoadMismatchError("\n".join(lines))


# -- step 1: names ----------------------------------------------------------------------------------------
def _renamed(chosen: list, available: list, mapping, where: str) -> dict:
    """checkpoint name -> destination name (None: left out) for every name of ``chosen``."""
    if mapping is None:
        return {n: n for n in chosen}
    if isinstance(mapping, Mapping):
        known = set(available)
        for k, v in mapping.items():
            if not isinstance(k, str):
                raise ArgumentTypeError(f"mapping keys must be checkpoint tensor names (str), got {k!r}")
            if k not in known:
                raise TensorNotFoundError(f"{where}: no tensor named {k!r} (a key of mapping)")
            if v is not None and not isinstance(v, str):
                raise ArgumentTypeError(f"mapping[{k!r}] must be a destination name (str) or None, got {v!r}")
        return {n: mapping.get(n, n) for n in chosen}
    if callable(mapping):
        out = {}
        for n in chosen:
            v = mapping(n)
            if v is not None and not isinstance(v, str):
                raise ArgumentTypeError(f"mapping({n!r}) returned {v!r}; expected a destination name (str) or None")
            out[n] = v
        return out
    raise ArgumentTypeError("mapping must be a dict of checkpoint name -> destination name, or a callable(name) -> "
                            f"name | None, got {type(mapping).__name__}")


def _groups(targets: dict) -> list:
    """The destinations as groups of names that are the same memory (tied), each group in the destinations'
    order; overlapping destinations that are not the same memory are refused."""
    index = {n: k for k, n in enumerate(targets)}
    by_ident, spans, alone = {}, [], []
    for n, t in targets.items():
        if t.span is not None:
            spans.append((t.span[0], t.span[1], t.span[2], n))
        elif t.ident is not None:
            by_ident.setdefault(t.ident, []).append(n)
        else:
            alone.append([n])
    groups = list(by_ident.values()) + alone
    spans.sort(key=lambda s: (repr(s[0]), s[1], s[2]))
    current, place, reach, holder = None, None, 0, None   # holder: the name whose bytes reach furthest
    for where, start, stop, n in spans:
        t = targets[n]
        if current is not None and where == place and start < reach:
            if t.span == targets[current[0]].span and t.layout == targets[current[0]].layout:
                current.append(n)
                continue
            raise InvalidArgumentError(f"destinations {holder!r} and {n!r} overlap in memory without being the same "
                                       "tensor: each needs memory of its own (or be the very same tensor, tied)")
        current = [n]
        groups.append(current)
        if where != place or stop > reach:
            place, reach, holder = where, stop, n
    for g in groups:
        g.sort(key=index.__getitem__)
    return groups


def plan_into(w, targets: dict, *, names=None, slices=None, mapping=None, strict: bool = True, dequantize=False,
              threads=None, into: str = "the destinations") -> IntoPlan:
    """The checked read plan of a load of the open checkpoint ``w`` (:class:`mcf.loaders.weights.Weights`
    or :class:`mcf.loaders.gguf_weights.GGUFWeights`) into ``targets`` (destination name -> :class:`Target`):
    steps 1 and 2 of the module docstring.  Raises before anything is read."""
    kind = dequantize_kind(dequantize)
    available = w.use_weights(kind)
    chosen, specs = selection(names, slices, available, w.where)
    renamed = _renamed(chosen, available, mapping, w.where)
    wanted = {}   # destination name -> checkpoint name
    for ck, dest in renamed.items():
        if dest is None:
            continue
        if dest in wanted:
            raise InvalidArgumentError(f"{w.where}: the checkpoint's {wanted[dest]!r} and {ck!r} both map to the "
                                       f"destination {dest!r}")
        wanted[dest] = ck
    unexpected = [ck for ck, dest in renamed.items() if dest is not None and dest not in targets]
    missing, source = [], {}   # source: checkpoint name -> the destination it fills
    for group in _groups(targets):
        held = sorted(n for n in group if n in wanted)
        if not held:
            missing.extend(group)
            continue
        source[wanted[held[0]]] = held[0]
        unexpected.extend(wanted[n] for n in held[1:])   # a tied group is filled once
    order = {n: k for k, n in enumerate(chosen)}
    unexpected.sort(key=order.__getitem__)
    index = {n: k for k, n in enumerate(targets)}
    missing.sort(key=index.__getitem__)
    loaded = [n for n in chosen if n in source]
    threads_ = decode_threads(threads)
    first = w.pieces(loaded, specs, None, threads=threads_, dequantize=kind)
    sizes, want = [], {}
    for p in first:
        t = targets[source[p.name]]
        if tuple(p.shape) != tuple(t.shape):
            sizes.append((p.name, t.name, p.shape, t.shape))
        if p.element.name == t.element.name or p.element.name in t.bits_of:
            want[p.name] = None
        elif p.element.name in FLOAT_ELEMENTS and t.element.name in FLOAT_ELEMENTS:
            want[p.name] = t.element.name
        else:
            raise DTypeError(f"{w.where}: tensor {p.name!r} loads as {p.element.name}, its destination {t.name!r} "
                             f"holds {t.element.name}: mcf casts only between F16, BF16, F32 and F64, into which it "
                             "also decodes quantized tensors (and block-scaled weights with dequantize=)")
    if sizes or (strict and (missing or unexpected)):
        raise mismatch_error(w.where, into, missing=missing if strict else (), unexpected=unexpected if strict else (),
                             sizes=sizes)
    by_kind = {}
    for n in loaded:
        by_kind.setdefault(want[n], []).append(n)
    pieces = {p.name: p for p in first if want[p.name] is None}
    for el, group in by_kind.items():
        if el is not None:
            deq = el if kind else None
            pieces.update((p.name, p) for p in w.pieces(group, specs, el, threads=threads_, dequantize=deq))
    out = [pieces[n] for n in loaded]
    for p in out:
        t = targets[source[p.name]]
        if p.element.name != t.element.name and p.element.name not in t.bits_of:
            raise AssertionError(f"plan_into: {p.name} planned as {p.element.name} for {t.element.name}")
    return IntoPlan(out, {n: targets[source[n]] for n in loaded}, missing, unexpected)


# -- step 3: the fill -------------------------------------------------------------------------------------
def _out(memory: np.ndarray, p) -> np.ndarray:
    """``memory`` (flat uint8) as the executor's ``out`` for piece ``p``: the kernels' dtype and the piece's
    shape for a float element, the bytes otherwise (read straight in)."""
    nbytes = -(-math.prod(p.shape) * p.element.bits // 8)
    if memory.size != nbytes:
        raise AssertionError(f"fill: {p.name} needs {nbytes} bytes, its destination holds {memory.size}")
    kernel = _KERNEL_NUMPY.get(p.element.name)
    return memory.view(kernel).reshape(p.shape) if kernel is not None else memory


def fill(pieces: list, targets: dict, *, threads=None, chunk_bytes=None, group=None, weights=None) -> None:
    """Carry out ``pieces`` into ``targets`` (piece name -> :class:`Target`, none pending): the ones with
    ``memory`` in one read plan straight into it, the others through staging batches of at most
    :data:`STAGING_BYTES` (a larger tensor alone) that their ``store`` copies into them.

    ``group``: the :class:`mcf.loaders.distributed.GroupLoad` whose ranks share the reads (``weights``: the
    open checkpoint the pieces come from).  The ranks' broadcasts land in each target's memory; a target
    without memory is staged whole (the broadcasts of every tensor are in flight together) and stored once
    the load is done."""
    direct = [p for p in pieces if targets[p.name].memory is not None]
    staged = [p for p in pieces if targets[p.name].memory is None]
    if any(targets[p.name].pending or targets[p.name].store is None for p in staged):
        raise AssertionError("fill: a destination has neither memory nor a store")
    if group is not None:
        _group_fill(pieces, targets, group, weights, threads, chunk_bytes)
        return
    if direct:
        execute(direct, lambda p: (None, _out(targets[p.name].memory, p)), threads=threads, chunk_bytes=chunk_bytes,
                fresh=False)
    batch, held = [], 0
    for p in staged:
        nbytes = targets[p.name].nbytes
        if batch and held + nbytes > STAGING_BYTES:
            _staged(batch, targets, threads, chunk_bytes)
            batch, held = [], 0
        batch.append(p)
        held += nbytes
    if batch:
        _staged(batch, targets, threads, chunk_bytes)


def _staged(batch: list, targets: dict, threads, chunk_bytes) -> None:
    def alloc(p):
        buf = aligned_bytes(targets[p.name].nbytes)
        return buf, _out(buf, p)

    bufs = execute(batch, alloc, threads=threads, chunk_bytes=chunk_bytes)
    for p in batch:
        targets[p.name].store(bufs[p.name])


def _group_fill(pieces: list, targets: dict, group, weights, threads, chunk_bytes) -> None:
    staging, total = {}, 0

    def alloc(p):
        nonlocal total
        t = targets[p.name]
        if t.memory is not None:
            return None, _out(t.memory, p)
        total += t.nbytes
        with allocating(t.nbytes, p.source.name, p.name, total=total):
            buf = staging[p.name] = aligned_bytes(t.nbytes)
        return None, _out(buf, p)

    group.load(pieces, alloc, weights=weights, threads=threads, chunk_bytes=chunk_bytes, fresh=False)
    for name in list(staging):   # each staging buffer released once stored
        targets[name].store(staging.pop(name))


# -- the numpy face --------------------------------------------------------------------------------------
def _numpy_elements() -> dict:
    out = {}
    for e in ELEMENTS.values():
        if e.numpy is not None:
            out.setdefault(numpy_dtype(e, e.name), e)
    return out


_BY_NUMPY = _numpy_elements()


def numpy_target(name: str, arr) -> Target:
    """The :class:`Target` of the numpy array ``arr`` (writable, native byte order)."""
    if not isinstance(arr, np.ndarray):
        raise ArgumentTypeError(f"destination {name!r} must be a numpy array, got {type(arr).__name__}")
    if not arr.flags.writeable:
        raise InvalidArgumentError(f"destination {name!r} is read-only (a view of a mapped file, or "
                                   "setflags(write=False)): pass writable arrays")
    problem = byte_order_problem(arr.dtype, f"destination {name!r}")
    if problem:
        raise DTypeError(problem)
    el = _BY_NUMPY.get(arr.dtype)
    if el is None:
        raise DTypeError(f"destination {name!r} is {arr.dtype}, which holds no tensor element type")
    bits_of = frozenset(e.name for e in ELEMENTS.values()
                        if e.numpy is not None and e is not el and numpy_dtype(e, e.name) == arr.dtype)
    span = layout = None
    if arr.size:
        low, high = np.lib.array_utils.byte_bounds(arr) if hasattr(np.lib, "array_utils") else np.byte_bounds(arr)
        span, layout = ("cpu", low, high), (arr.shape, arr.strides, arr.dtype.str)
    if arr.flags.c_contiguous and arr.flags.aligned:
        return Target(name, el, arr.shape, memory=arr.reshape(-1).view(np.uint8), span=span, layout=layout,
                      bits_of=bits_of)

    def store(buf, arr=arr):
        np.copyto(arr, buf.view(arr.dtype).reshape(arr.shape))

    return Target(name, el, arr.shape, store=store, span=span, layout=layout, bits_of=bits_of)


def open_for_into(filename, *, mmap=None):
    """The open checkpoint a load into memory reads: a GGUF file (a :class:`mcf.gguf.GGUFFile`, a path whose
    first bytes are GGUF's magic, a URL ending ``.gguf``) as :class:`mcf.loaders.gguf_weights.GGUFWeights`,
    anything :func:`mcf.loaders.weights.open_weights` takes as its :class:`~mcf.loaders.weights.Weights`."""
    from mcf.gguf.reader import GGUFFile

    if isinstance(filename, GGUFFile):
        from mcf.loaders.gguf_weights import GGUFWeights

        return GGUFWeights(filename, False, str(filename.path))
    gguf = False
    if is_url(filename):
        gguf = url_name(os.fsdecode(filename)).endswith(".gguf")
    elif isinstance(filename, (str, os.PathLike)) and os.path.isfile(filename):
        with open(filename, "rb") as f:
            gguf = f.read(4) == b"GGUF"
    if gguf:
        from mcf.loaders.gguf_weights import open_gguf

        return open_gguf(filename, mmap=mmap)
    return open_weights(filename, mmap=mmap)


def load_into(arrays, filename, *, names=None, slices=None, mapping=None, strict: bool = True, dequantize=False,
              mmap=None, backend=None, threads=None, chunk_bytes=None) -> tuple:
    """Fill the numpy arrays ``arrays`` (a mapping destination name -> writable array) in place from a
    checkpoint; returns ``(missing, unexpected)``: the destination names nothing filled and the checkpoint
    names no destination took (``safetensors.torch.load_model``'s return value).

    ``filename``: anything :func:`mcf.load_file` reads (an MCF file, a safetensors file, directory, index or
    URL), or a GGUF file.  Every array keeps its memory: a tensor stored in the array's dtype is read straight
    into it, a float tensor of another float dtype is cast into it, a quantized MCF or GGUF tensor decoded
    into it (and block-scaled safetensors weights with ``dequantize=True``).  An array that is not
    C-contiguous (a strided view) is filled through bounded staging.

    ``names``/``slices``: as :func:`mcf.load_file`, over the checkpoint's names (a slice's destination has
    the slice's shape).  ``mapping``: a dict checkpoint name -> destination name (names it does not hold keep
    their own) or a callable(name) -> name; None as a destination leaves that tensor out.  ``strict=True``
    refuses any missing or unexpected tensor with one :class:`mcf.LoadMismatchError` naming all of them, and
    writes nothing; a shape that differs is refused whatever ``strict`` (also :class:`mcf.LoadMismatchError`),
    an element type that cannot be cast is :class:`mcf.DTypeError`, all before a byte is read.  Arrays that
    are the same memory (one array under two names) are filled once; arrays that overlap otherwise, and
    read-only arrays, are refused.  ``mmap``, ``backend``, ``threads``, ``chunk_bytes``: as
    :func:`mcf.load_file`.
    """
    if not isinstance(arrays, Mapping):
        raise ArgumentTypeError(f"arrays must be a mapping of name -> numpy array, got {type(arrays).__name__}")
    targets = {}
    for n, a in arrays.items():
        if not isinstance(n, str):
            raise ArgumentTypeError(f"destination names must be str, got {n!r}")
        targets[n] = numpy_target(n, a)
    with open_for_into(filename, mmap=mmap_of_backend(backend, mmap)) as w:
        plan = plan_into(w, targets, names=names, slices=slices, mapping=mapping, strict=strict,
                         dequantize=dequantize, threads=threads, into="the arrays")
        fill(plan.pieces, plan.targets, threads=threads, chunk_bytes=chunk_bytes)
    return plan.missing, plan.unexpected
