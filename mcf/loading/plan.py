"""A read plan: every tensor a load returns as a :class:`Piece` (which bytes of which source, and what
to make of them), carried out with as few calls into the read engine as the plan allows.

Why it looks this way:

- **Straight into the result.**  A piece whose stored bytes are already the result (no cast, no
  decoding) names the byte ranges to read, in the order they appear in the result; the executor
  allocates the result (one fresh array or tensor per piece, so freeing one frees its memory) and hands
  every such range of every piece to one :meth:`mcf.io.Source.read_into` call per source.  The engine
  sees the whole plan at once and can coalesce, split and parallelize it; nothing is copied twice.
- **Only the bytes asked for.**  A cut ``(dim, start, stop)`` of a row-major tensor is one range when
  it is contiguous in the file (a row range, a whole tensor, any cut of a tensor whose earlier
  dimensions are all 1) and one range per index of the earlier dimensions otherwise (a shard along
  dimension 1 reads ``shape[0]`` strided ranges, each straight into its row of the result).
- **Decoding goes through staging, in bounded batches.**  A cast (``dtype=``) or a quantized MCF
  tensor reads its stored bytes into a staging buffer, then decodes into the result.  Staged pieces
  are read in batches of at most :data:`STAGING_BYTES` stored bytes (one ``read_into`` per source
  each), so staging memory stays bounded however large the checkpoint.
- **Zero-copy is an opt-in.**  With ``copy=False`` a piece that is one contiguous stored range of a
  mapped source is returned as a view (the front end decides which: numpy's read-only view of the
  shared mapping, or torch's view of the private copy-on-write mapping).
- The formats describe their tensors (:func:`plain_piece` for row-major ones; the MCF container adds
  its quantized pieces); the front ends (numpy, torch) say how to allocate and how to view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mcf._core._io import Source, aligned_empty
from mcf._core.memory import allocating
from mcf._core.args import integer
from mcf.errors import FormatError, InvalidArgumentError
from mcf.loading.casts import cast_into
from mcf.loading.dtypes import FLOAT_ELEMENTS, Element

__all__ = ["Piece", "Stage", "plain_piece", "cut_ranges", "execute", "aligned_bytes", "source_options", "STAGING_BYTES",
           "mmap_of_backend", "ALIGN_FROM", "MAX_ARRAY_BYTES", "MAX_DIMS"]

#: Stored bytes of decoded pieces (casts, quantized tensors) read per batch.
STAGING_BYTES = 64 << 20
#: Results of at least this many bytes start on a page boundary: positional reads (and O_DIRECT) into
#: page-aligned memory run about twice as fast (docs/io.md); smaller ones skip the padding.
ALIGN_FROM = 64 << 10


@dataclass(eq=False)
class Stage:
    """Part of a decoded piece: the ranges ``offsets``/``sizes`` of the source fill a staging buffer of
    ``nbytes`` (at offsets ``dst``; None: one after the other), then ``decode(staging, out)`` writes its
    part of the result ``out``.  ``sources``, when given, names the source of each range (a weight whose
    scales and blocks are separate tensors, possibly in different shards); else they are the piece's.
    ``out_range``: the elements ``(start, stop)`` of the flattened result that ``decode`` writes, and no
    others (None: not stated), so that the stages of one piece can be read by different processes
    (:mod:`mcf.loaders.distributed`)."""

    offsets: np.ndarray
    sizes: np.ndarray
    dst: np.ndarray | None
    nbytes: int
    decode: Callable
    sources: list | None = None
    out_range: tuple | None = None


@dataclass(eq=False)
class Piece:
    """One tensor of the result: ``shape`` and ``element`` of what is returned, and where it comes from.

    Read straight into the result: ``offsets`` (a tuple, or an int64 array when there are many), the
    byte ranges of ``source`` of ``size`` bytes each that fill it in order.  Decoded: ``stages``
    (:class:`Stage`), each read into staging and decoded into its part of the result.  ``view``:
    ``(offset, nbytes)`` when the result is one contiguous stored range, unchanged, so ``copy=False`` may
    return a view of it.
    """

    name: str
    source: Source
    shape: tuple
    element: Element
    offsets: tuple | np.ndarray = ()
    size: int = 0
    stages: list | None = None
    view: tuple | None = None


def cut_ranges(offset: int, shape: tuple, itemsize: int, cut):
    """``(out_shape, offsets, size)`` of a cut ``(dim, start, stop)`` (or None: everything) of a row-major
    tensor at ``offset``: the file offsets of its ranges, every range ``size`` bytes, in the order they
    fill the result.  Contiguous cuts are one range."""
    shape = tuple(shape)
    if cut is None:
        nbytes = math.prod(shape) * itemsize
        return shape, np.array([offset] if nbytes else [], np.int64), nbytes
    dim, start, stop = cut
    out_shape = shape[:dim] + (stop - start,) + shape[dim + 1:]
    inner = math.prod(shape[dim + 1:]) * itemsize
    outer = math.prod(shape[:dim])
    size = (stop - start) * inner
    if size == 0 or outer == 0:
        return out_shape, np.empty(0, np.int64), 0
    if outer == 1 or (start == 0 and stop == shape[dim]):
        return out_shape, np.array([offset + start * inner], np.int64), size * outer
    row = shape[dim] * inner
    return out_shape, offset + start * inner + row * np.arange(outer, dtype=np.int64), size


_STORED = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64}


def _cast_stages(offsets: np.ndarray, size: int, itemsize: int, src_name: str) -> list:
    """Stages of at most :data:`STAGING_BYTES` (whole values) over equal ranges of ``size`` bytes, in
    result order, each cast into its span of the flat result."""
    cap = max(itemsize, STAGING_BYTES // itemsize * itemsize)
    stored = _STORED[src_name]

    def stage(offs, sz, first):   # first: the byte of the result stream this stage starts at
        n = offs.shape[0]
        nbytes = n * sz

        def decode(staging, out, _e0=first // itemsize, _n=nbytes // itemsize):
            cast_into(staging.view(stored), src_name, out.reshape(-1)[_e0:_e0 + _n])

        return Stage(offs, np.full(n, sz, np.int64), None, nbytes, decode,
                     out_range=(first // itemsize, (first + nbytes) // itemsize))

    out = []
    if size <= cap:
        per = cap // size
        for j in range(0, offsets.shape[0], per):
            out.append(stage(offsets[j:j + per], size, j * size))
    else:
        for r, off in enumerate(offsets.tolist()):
            for m in range(0, size, cap):
                out.append(stage(np.array([off + m], np.int64), min(cap, size - m), r * size + m))
    return out


#: numpy and torch index with int64: an array's dimensions, and its non-zero dimensions times its item
#: size, must stay below this (an empty tensor's other dimensions are otherwise unchecked by its byte size)
MAX_ARRAY_BYTES = (1 << 63) - 1
#: numpy 1.x holds at most 32 dimensions (numpy 2: 64); safetensors sets no limit
MAX_DIMS = 32


def plain_piece(name: str, source: Source, offset: int, shape: tuple, element: Element, cut, *,
                out: Element | None = None, what: str = "") -> Piece:
    """The piece of a row-major tensor of ``element`` stored at ``offset``: cut ``(dim, start, stop)``
    (None: whole), cast to the float element ``out`` when it differs (F16, BF16, F32 and F64 only)."""
    itemsize = element.itemsize
    widest = max(itemsize, out.itemsize if out is not None else 0, 1)
    if math.prod([d for d in shape if d]) * widest > MAX_ARRAY_BYTES:
        raise FormatError(f"shape {list(shape)} is too large for an array", path=source.name,
                          field=f"tensor {name!r}.shape", expected="non-zero dims * itemsize < 2**63")
    if len(shape) > MAX_DIMS:
        raise FormatError(f"{len(shape)} dimensions are more than numpy holds", path=source.name,
                          field=f"tensor {name!r}.shape", expected=f"<= {MAX_DIMS}")
    same = out is None or out.name == element.name
    if cut is None and same:   # the common case, kept cheap: checkpoints can hold 10**5 tensors
        nbytes = math.prod(shape) * itemsize if itemsize else -(-math.prod(shape) * element.bits // 8)
        return Piece(name, source, tuple(shape), element, (offset,) if nbytes else (), nbytes,
                     view=(offset, nbytes))
    if itemsize == 0:
        raise InvalidArgumentError(f"{what}: {element.name} packs values below a byte: it loads whole, "
                                   "a slice of it cannot be read")
    out_shape, offsets, size = cut_ranges(offset, shape, itemsize, cut)
    n = offsets.shape[0]
    if same:
        view = (int(offsets[0]), size) if n == 1 else ((offset, 0) if n == 0 else None)
        return Piece(name, source, out_shape, element, tuple(offsets.tolist()) if n <= 1 else offsets, size,
                     view=view)
    if element.name not in FLOAT_ELEMENTS or out.name not in FLOAT_ELEMENTS:
        raise AssertionError(f"plain_piece: no cast from {element.name} to {out.name}")
    stages = _cast_stages(offsets, size, itemsize, element.name) if n else []
    return Piece(name, source, out_shape, out, stages=stages)


def _split(flat: np.ndarray, n: int, size: int) -> list:
    """``flat`` cut into ``n`` consecutive buffers of ``size`` bytes."""
    if n <= 1:
        return [flat] if n else []
    return list(flat.reshape(n, size))


class _Reads:
    """The ranges of one batch, per source, handed to one ``read_into`` each."""

    def __init__(self):
        self.by_source = {}

    def add(self, source: Source, offsets, buffers: list) -> None:
        if buffers:
            entry = self.by_source.get(id(source))
            if entry is None:
                entry = self.by_source[id(source)] = (source, [], [])
            entry[1].extend(offsets if type(offsets) is tuple else offsets.tolist())
            entry[2].extend(buffers)

    def run(self, threads, chunk_bytes) -> None:
        for src, offs, dests in self.by_source.values():
            src.read_into(np.array(offs, np.int64), dests, threads=threads, chunk_bytes=chunk_bytes)
        self.by_source = {}


def execute(pieces: list, alloc: Callable, *, view: Callable | None = None, threads=None, chunk_bytes=None) -> dict:
    """Carry out ``pieces``: ``name -> result`` in the order of ``pieces``.

    ``alloc(piece) -> (result, out)`` makes a fresh result for ``piece`` and the numpy array ``out`` over
    its memory (C-contiguous, ``piece.shape``; bfloat16 may be its uint16 bits).  The results together may
    not be more than the machine's memory (:mod:`mcf._core.memory`): the piece that would pass it is an
    :class:`mcf.AllocationError`, before any byte is read.  ``view(piece) -> result | None``,
    when given (``copy=False``), may return a zero-copy result for a piece with a ``view`` range; None
    reads it like the others.
    """
    if threads is not None:
        integer(threads, "threads", minimum=1)
    if chunk_bytes is not None:
        integer(chunk_bytes, "chunk_bytes", minimum=1)
    results = {}
    direct = _Reads()
    stages = []
    total = 0   # bytes of the results allocated so far: all of them are returned together
    for p in pieces:
        if view is not None and p.view is not None and p.stages is None:
            r = view(p)
            if r is not None:
                results[p.name] = r
                continue
        nbytes = -(-math.prod(p.shape) * p.element.bits // 8)
        total += nbytes
        with allocating(nbytes, p.source.name, p.name, total=total):   # refused before any of it is read
            result, out = alloc(p)
        results[p.name] = result
        if p.stages is None:
            direct.add(p.source, p.offsets, _split(out.reshape(-1).view(np.uint8), len(p.offsets), p.size))
        else:
            stages.extend((p.source, s, out) for s in p.stages)
    direct.run(threads, chunk_bytes)
    batch, held = [], 0
    for item in stages:
        if batch and held + item[1].nbytes > STAGING_BYTES:
            _decode_batch(batch, threads, chunk_bytes)
            batch, held = [], 0
        batch.append(item)
        held += item[1].nbytes
    if batch:
        _decode_batch(batch, threads, chunk_bytes)
    return {p.name: results[p.name] for p in pieces}


def _decode_batch(batch, threads, chunk_bytes) -> None:
    reads = _Reads()
    stagings = []
    for src, st, _ in batch:
        staging = aligned_empty(st.nbytes, 64)
        if st.dst is None:   # equal ranges, one after the other
            bufs = _split(staging[:st.nbytes], st.sizes.shape[0], int(st.sizes[0]) if st.sizes.shape[0] else 0)
        else:
            bufs = [staging[d:d + s] for d, s in zip(st.dst.tolist(), st.sizes.tolist())]
        if st.sources is None:
            reads.add(src, st.offsets, bufs)
        else:
            for source, off, buf in zip(st.sources, st.offsets.tolist(), bufs):
                reads.add(source, (off,), [buf])
        stagings.append(staging)
    reads.run(threads, chunk_bytes)
    for (_, st, out), staging in zip(batch, stagings):
        st.decode(staging, out)


def aligned_bytes(nbytes: int) -> np.ndarray:
    """Fresh uint8 memory for one result: page-aligned from :data:`ALIGN_FROM` bytes on (smaller results
    skip the padding page)."""
    return aligned_empty(nbytes, 4096) if nbytes >= ALIGN_FROM else np.empty(nbytes, np.uint8)


def mmap_of_backend(backend, mmap):
    """``mmap`` from safetensors' ``backend=`` keyword (``"mmap"`` or ``"pread"``), which the drop-ins take so
    that a call written for safetensors runs unchanged; None leaves ``mmap`` as given."""
    if backend is None:
        return mmap
    if backend not in ("mmap", "pread"):
        raise InvalidArgumentError(f"backend must be 'mmap' or 'pread' (as in safetensors), got {backend!r}")
    if mmap is not None and bool(mmap) != (backend == "mmap"):
        raise InvalidArgumentError(f"backend={backend!r} and mmap={mmap!r} disagree: pass one of them")
    return backend == "mmap"


def source_options(mmap, copy: bool) -> dict:
    """The keywords a loader passes to a reader it opens: ``mmap`` as the caller gave it, or nothing
    (the reader's default, which suits the storage) for None, except that ``copy=False`` asks for a
    mapping: its views are what the caller asked for."""
    if mmap is None:
        return {} if copy else {"mmap": True}
    return {"mmap": bool(mmap)}
