"""numpy destinations of a read plan: one fresh array per tensor (the default, what
``safetensors.numpy.load_file`` returns), or with ``copy=False`` read-only views of a mapped file.

Views over the shared mapping are read-only and refuse ``setflags(write=True)`` (a write there would be
a SIGSEGV: see :mod:`mcf.io`); a piece that is not one contiguous stored range of a mapped file (a shard
along dimension 1, a cast, a quantized tensor, a file read with pread or from a URL) is read into a
fresh array instead, so every result is C-contiguous.
"""

from __future__ import annotations

import math

import numpy as np

from mcf.loading.dtypes import numpy_dtype
from mcf.loading.plan import ALIGN_FROM, aligned_bytes, execute

__all__ = ["load_arrays"]


def load_arrays(pieces: list, *, copy: bool = True, threads=None, chunk_bytes=None) -> dict:
    """``name -> numpy array`` for ``pieces`` (see :func:`mcf.loading.plan.execute`).  Element types numpy
    cannot hold (F4, F6) are refused before anything is read."""
    dtypes = {}
    known = {}
    for p in pieces:   # one lookup per element type, each refusal naming the first tensor it meets
        dt = known.get(p.element.name)
        if dt is None:
            dt = known[p.element.name] = numpy_dtype(p.element, f"{p.source.name}: tensor {p.name!r}")
        dtypes[p.name] = dt

    def alloc(p):
        dt = dtypes[p.name]
        nbytes = math.prod(p.shape) * dt.itemsize
        a = aligned_bytes(nbytes).view(dt).reshape(p.shape) if nbytes >= ALIGN_FROM else np.empty(p.shape, dt)
        return a, a

    def view(p):
        if not p.source.is_mapped:
            return None
        return p.source.array(p.view[0], dtypes[p.name], p.shape)

    return execute(pieces, alloc, view=None if copy else view, threads=threads, chunk_bytes=chunk_bytes)
