"""What every tensor loader of mcf shares, whatever the format and whatever the destination.

The loaders (:func:`mcf.safetensors.load_file`, :func:`mcf.load_file`, :func:`mcf.load_state_dict`,
:func:`mcf.torch.load_file`, :func:`mcf.torch.load_state_dict`) all take the same selection:

- ``names=``: tensor names or glob patterns (:mod:`mcf.loading.select`);
- ``slices=``: per tensor name or pattern, a :class:`Rows` range or a :class:`Shard` (rank ``k`` of ``n``
  along a dimension), so a tensor-parallel rank reads only its own bytes (:mod:`mcf.loading.slices`).

Underneath, each format describes the tensors asked for as pieces of byte ranges, and one executor
reads them with the I/O core's :meth:`mcf.io.Source.read_into` straight into the arrays or tensors that
are returned (:mod:`mcf.loading.plan`); element types follow one table (:mod:`mcf.loading.dtypes`).
This package is part of the core: it knows no format.
"""

from mcf.loading.slices import Rows, Shard

__all__ = ["Rows", "Shard"]
